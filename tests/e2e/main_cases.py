"""Run `hftrain.finetune.main(argv)` for many argument lists in one Python process, for the refusal tests.

    python tests/e2e/main_cases.py cases.json results.json

cases.json: {name: {"argv": [...], "env": {...}}}; results.json: {name: {"exit_code": int, "stderr": str}}.
Each refused case would otherwise be a process of its own that imports torch, transformers and accelerate again
(~5 s each on 2 CPU cores). The entry point is the same `main(argv)` that `python -m hftrain.finetune` and
`accelerate launch hftrain/finetune.py` call; what the launcher itself adds is tested by launches elsewhere.
Between cases the environment is restored and accelerate's process-wide state is reset, so that no case sees
another's accelerator. An exception escaping `main` is written to the case's stderr as Python would print it.
"""

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from hftrain.finetune import main  # noqa: E402


def run_case(argv: list[str], env: dict[str, str]) -> dict:
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    stderr, exit_code = io.StringIO(), 0
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except SystemExit as stop:
        exit_code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception, the test then fails on it
        stderr.write(traceback.format_exc())
        exit_code = 1
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return {"exit_code": exit_code, "stderr": stderr.getvalue()}


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = {name: run_case(case["argv"], case.get("env", {})) for name, case in cases.items()}
    Path(sys.argv[2]).write_text(json.dumps(results))
