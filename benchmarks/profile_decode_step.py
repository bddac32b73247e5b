"""Where a batch-1 decode step's time goes, on the realistic LLaVA (bench_model.py): the engine step's
wall time split into the model's linears, paged attention, rotary, RMSNorm, the rest of the forward,
the sampler, and the engine around the model (scheduling, positions and metadata, outputs). A layer that runs
natively (models/native_decode.py) is one part, "native decode layers", its linears included; the linears
part is then the lm_head's.

Module times come from forward hooks (perf_counter around each call; the hooks' own cost, a few
microseconds a call, lands in the measured parts), the sampler's from wrapping it where the runner
calls it. Prints milliseconds per step and shares; `benchmarks/README.md` keeps a measured table.

    .venv/bin/python -m benchmarks.profile_decode_step [--dtype float32|bfloat16] [--quantization int8]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from benchmarks.bench_model import bench_model
from tessera import LLM, SamplingParams
from tessera.engine.core import model_runner
from tessera.layers.attention import PagedAttention
from tessera.layers.layernorm import RMSNorm
from tessera.layers.linear import Linear
from tessera.layers.rotary import RotaryEmbedding
from tessera.models.native_decode import NativeDecodeLayer

PARTS = {Linear: "linears", PagedAttention: "paged attention", RotaryEmbedding: "rotary", RMSNorm: "RMSNorm"}
PROMPT = "USER: Tell me a long story about a lighthouse. ASSISTANT:"


def hook_times(model, totals: dict[str, float]) -> None:
    """Add each module of PARTS' time to totals[part] (outermost calls only: no double counting)."""
    depth = defaultdict(int)

    for module in model.modules():
        part = next((name for cls, name in PARTS.items() if isinstance(module, cls)), None)
        if part is None:
            continue

        def pre(mod, args, part=part):
            depth[part] += 1
            if depth[part] == 1:
                mod._t0 = time.perf_counter()

        def post(mod, args, out, part=part):
            depth[part] -= 1
            if depth[part] == 0:
                totals[part] += time.perf_counter() - mod._t0

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(str(bench_model()), kv_cache_memory="1GiB", dtype=args.dtype, quantization=args.quantization)
    engine = llm.engine
    totals: dict[str, float] = defaultdict(float)
    hook_times(engine.core.model, totals)
    sample = model_runner.sample

    def timed(function, part: str):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                totals[part] += time.perf_counter() - start

        return wrapper

    # the decoder and the lm_head (compute_logits): the modules of PARTS run inside one or the other
    model = engine.core.model
    model.forward, model.compute_logits = timed(model.forward, "forward"), timed(model.compute_logits, "forward")
    model_runner.sample = timed(sample, "sampler")
    native_call = NativeDecodeLayer.__call__
    NativeDecodeLayer.__call__ = timed(native_call, "native decode layers")
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    engine.add_request("profile", PROMPT, params)
    engine.step()  # the prefill: not counted
    totals.clear()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    model_runner.sample = sample
    NativeDecodeLayer.__call__ = native_call

    parts = {name: totals[name] for name in (*PARTS.values(), "native decode layers")}
    rows = [
        *parts.items(),
        ("other forward ops", totals["forward"] - sum(parts.values())),
        ("sampler", totals["sampler"]),
        ("engine around the model", wall - totals["forward"] - totals["sampler"]),
    ]
    label = args.dtype + (f" + {args.quantization}" if args.quantization else "")
    print(f"batch-1 decode, {label}: {steps} steps, {1000 * wall / steps:.1f} ms a step")
    for name, seconds in rows:
        print(f"  {name:<26} {1000 * seconds / steps:6.2f} ms  {100 * seconds / wall:5.1f}%")


if __name__ == "__main__":
    main()
