"""Streaming training data (`streaming: true`): read, tokenized and packed on the fly, resumed exactly.

The rooms: `sources` (where rows come from, mixtures), `rows` (`RowStream`: tokenized, packed, with its position),
`feed` (`StreamFeed`, the collator, the saved state and its resume checks), `load` (`load_stream`, `read_states`).

The training set is a `datasets.IterableDataset` of raw examples (local data files, a folder of them, a saved
`datasets` folder or a hub id; `load_dataset(..., streaming=True)` / `to_iterable_dataset`). Nothing is tokenized
or cached before step 1: `RowStream` pulls raw examples one at a time, through an optional seeded shuffle buffer,
tokenizes and masks each with the same code as map-style data (`tokenize.tokenize_rows` / `tokenize_pair`), drops
rows without a trained token (counted), packs rows on the fly when `packing` is on, and hands out training rows.

Ranks. With a shard count divisible by the data-parallel world, `split_dataset_by_node(strategy="shards")` gives
each rank its own shards: each rank streams, shuffles and packs its own rows and takes
per_device_train_batch_size x gradient_accumulation_steps of them per step. Otherwise (one file, say) every rank
reads and tokenizes the whole stream and keeps its slice of each global batch exactly as `BatchPlan` slices a
map-style global batch, so a streamed run with sequential order and no packing trains the rows of the map-style
run, and 2 processes train the rows of 1 process with the same global batch. (datasets' own "examples" split keeps
one raw example in world; that would give other rows to each rank than the map-style plan does.)

Exact resume. A checkpoint holds, per rank, the stream's state at the step boundary (`StreamFeed.state_dict`):
datasets' `state_dict()` of the raw stream (position in shards and examples; on resume datasets skips whole shards;
`.jsonl` files, read by `jsonlines`, seek to the byte offset of the next line, while datasets' other readers re-read
the current shard up to the position without decoding it into examples; nothing is tokenized again), the shuffle
buffer's raw examples and its generator state, rows already tokenized but not yet trained (an expanded
conversation's later turns), the partly filled packs, and the counters. A resumed run trains exactly the rows the
uninterrupted run would have. When the stream ends the next pass (epoch) starts from its beginning; with random
order its shards come in a new order (datasets' `set_epoch`, seeded by data_seed and the pass) and the shuffle
buffer's generator goes on, so a shuffled pass differs from the previous one.
"""


from hftrain.data.streaming.feed import StreamCollator, StreamFeed, StreamPlan, check_resume
from hftrain.data.streaming.load import load_stream, read_states
from hftrain.data.streaming.rows import RowStream
from hftrain.data.streaming.sources import StreamSource, stream_source

__all__ = ["RowStream", "StreamCollator", "StreamFeed", "StreamPlan", "StreamSource", "check_resume", "load_stream",
           "read_states", "stream_source"]
