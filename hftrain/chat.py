"""`hftrain chat FOLDER`: talk to a trained model in the terminal.

    hftrain chat outputs/run/final [--system "You are terse."] [--max_new_tokens 256] [--do_sample --temperature 0.7]
    printf 'Hi\\nAnd then?\\n' | hftrain chat outputs/run/final     # scripted: one turn per line of stdin

FOLDER is a final folder, a merged folder, an adapter folder (its base from adapter_config.json, or
--base_model_name_or_path) or a checkpoint-N saved by one process or DDP (hftrain.trained). Each turn is rendered
with the folder's chat template (the whole conversation so far, then the generation prompt) and generated with the
folder's generation config, which the options here override; the reply is printed token by token as it is
generated and kept in the conversation. `/reset` starts a new conversation (the system message stays), `/exit` or
end of input ends. When stdin is not a terminal, every line is one turn and only the replies are printed (one
line each), so the command can be scripted.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import TextIO

import torch
from transformers import TextStreamer, set_seed

from hftrain import trained
from hftrain.errors import HftrainError, first_line, run_tool
from hftrain.options import Parser, add_switch

COMMANDS = ("/reset", "/exit")


class Relay(TextStreamer):
    """transformers' TextStreamer (whole words as soon as they are decoded), written to `out` instead of print."""

    def __init__(self, tokenizer, out: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text)
        self.out.flush()


class Conversation:
    """The messages so far and how to answer the next one."""

    def __init__(self, model, tokenizer, generation_config, system: str | None = None):
        self.model, self.tokenizer, self.generation_config = model, tokenizer, generation_config
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict] = list(self.system)

    def reset(self) -> None:
        self.messages = list(self.system)

    def reply(self, text: str, out: TextIO) -> str:
        """Add the user's turn, stream the model's answer to `out` and keep it; returns the answer."""
        messages = [*self.messages, {"role": "user", "content": text}]
        try:
            inputs = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                                        return_tensors="pt")
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and the template's own raise_exception
            raise HftrainError(f"the chat template cannot render this conversation: {first_line(exc)}. Use "
                               "--chat_template with a template that accepts it (e.g. one with a system role)"
                               ) from None
        inputs = inputs.to(self.model.device)
        with torch.inference_mode():
            output = self.model.generate(**inputs, generation_config=self.generation_config,
                                         streamer=Relay(self.tokenizer, out))
        answer = self.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        return answer


def generation_config(model, tokenizer, args: argparse.Namespace):
    """The folder's generation config with the command line's settings on top."""
    config = copy.deepcopy(model.generation_config)
    overrides = {name: getattr(args, name) for name in ("max_new_tokens", "temperature", "top_p", "do_sample")
                 if getattr(args, name) is not None}
    if {"temperature", "top_p"} & set(overrides) and "do_sample" not in overrides:
        overrides["do_sample"] = True  # a temperature asks for sampling; greedy would ignore it
    config.update(**overrides)
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return config


def check_options(args: argparse.Namespace) -> None:
    problems = []
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        problems.append(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature is not None and args.temperature <= 0:
        problems.append(f"--temperature must be > 0 (for greedy decoding use --no-do_sample), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        problems.append(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        problems.append(f"--chat_template {args.chat_template!r} is not a file")
    if problems:
        raise HftrainError("; ".join(problems))


def turns(stdin: TextIO, interactive: bool, err: TextIO):
    """The user's turns: prompted lines from a terminal, else every line of stdin."""
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                err.write("\n")
                return
        else:
            line = stdin.readline()
            if not line:
                return
        yield line.rstrip("\n")


def chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout,
         err: TextIO = sys.stderr) -> None:
    check_options(args)
    if args.seed is not None:
        set_seed(args.seed)
    loaded = trained.load(args.folder, args.base_model_name_or_path, args.chat_template, dtype=args.dtype)
    if not loaded.tokenizer.chat_template:
        raise HftrainError(f"{args.folder}'s tokenizer has no chat template; pass --chat_template FILE.jinja")
    config = generation_config(loaded.model, loaded.tokenizer, args)
    conversation = Conversation(loaded.model, loaded.tokenizer, config, args.system)
    interactive = stdin.isatty()
    mode = "sampling" if config.do_sample else "greedy"
    err.write(f"hftrain chat: {loaded.folder.describe()} on {loaded.model.device}; {mode}, up to "
              f"{config.max_new_tokens} new tokens. /reset starts over, /exit ends\n")
    for text in turns(stdin, interactive, err):
        command = text.strip()
        if command == "/exit":
            return
        if command == "/reset":
            conversation.reset()
            err.write("hftrain chat: new conversation\n")
            continue
        if not command:
            continue
        if interactive:
            out.write("model> ")
        try:
            conversation.reply(text, out)
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the conversation
            err.write("\n(interrupted)\n")
            continue
        out.write("\n")
        out.flush()


def build_arg_parser(prog: str = "hftrain chat") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=__doc__.split("\n\n")[0].replace("`", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("folder", type=Path, help="final, merged, adapter or checkpoint-N folder")
    parser.add_argument("--system", default=None, help="System message at the start of every conversation.")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="Longest answer in tokens (default 256).")
    add_switch(parser, "--do_sample", default=None, negatable=True,
               help="Sample (--do_sample true) or decode greedily (--do_sample false); default: the folder's "
               "generation config, greedy when it says nothing (--temperature / --top_p imply sampling).")
    parser.add_argument("--temperature", type=float, default=None, help="Sampling temperature.")
    parser.add_argument("--top_p", type=float, default=None, help="Nucleus sampling probability mass.")
    parser.add_argument("--seed", type=int, default=None, help="Seed for sampling (repeatable answers).")
    parser.add_argument("--chat_template", default=None, help="A Jinja chat template file to use instead of the "
                        "folder's.")
    trained.add_loading_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "hftrain chat") -> None:
    args = build_arg_parser(prog).parse_args(argv)
    run_tool(chat, args)


if __name__ == "__main__":
    main()
