"""On a CUDA machine: is channels_last faster than NCHW for cuDNN (the layout pass's rule
``LAYOUT_RULES["cuda"]``), and does the middleware's CUDA vendor path match PyTorch?

For each network and batch size: eager NCHW and eager channels_last in fp32 with
PyTorch's default cuDNN settings (TF32 convolutions allowed, ``cudnn.benchmark`` off, then
on), timed with CUDA events as the median of interleaved rounds; then ``optimize(model,
device="cuda")`` against eager with TF32 off (max relative error).

    python bench/cuda_layout.py --nets resnet50,mobilenet_v2 --batch 16,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import cuda_medians  # noqa: E402
from zoo import NETWORKS  # noqa: E402


def time_cuda(fns: dict, rounds: int = 20, warmup: int = 5) -> dict[str, float]:
    """Median ms per function over interleaved rounds, timed with CUDA events."""
    return cuda_medians(fns, rounds, warmup)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nets", default="resnet18,resnet50,mobilenet_v2,densenet121,googlenet")
    p.add_argument("--batch", default="16,64")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    import middleware

    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for net in args.nets.split(","):
        torch.manual_seed(0)
        make, size = NETWORKS[net]
        model = make().eval().cuda()
        model_cl = make().eval().cuda().to(memory_format=torch.channels_last)
        model_cl.load_state_dict(model.state_dict())
        for b in [int(s) for s in args.batch.split(",")]:
            x = torch.randn(b, 3, size, size, device="cuda")
            x_cl = x.contiguous(memory_format=torch.channels_last)
            res = {}
            for bench in (False, True):
                torch.backends.cudnn.benchmark = bench
                with torch.inference_mode():
                    t = time_cuda(
                        {
                            "nchw": lambda m=model, a=x: m(a),
                            "nhwc": lambda m=model_cl, a=x_cl: m(a),
                        },
                        args.rounds,
                    )
                res[bench] = t
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
            with torch.inference_mode():
                ref = model(x)
            try:
                opt = middleware.optimize(model, device="cuda", example_inputs=(x,))
                y = opt(x)
                err = float((y - ref).abs().max()) / max(1.0, float(ref.abs().max()))
                tm = time_cuda(
                    {"eager": lambda m=model, a=x: m(a), "middleware": lambda m=opt, a=x: m(a)}, 10
                )
                counts = opt.report().counts()
            except Exception as e:  # report and go on with the layout timings
                print(f"{net} b{b}: optimize failed: {type(e).__name__}: {e}", flush=True)
                err, tm, counts = float("nan"), {"eager": 0.0, "middleware": 0.0}, {}
            torch.backends.cudnn.allow_tf32 = True
            print(
                f"{net} b{b}: cudnn.benchmark off: nchw {res[False]['nchw']:.2f} ms, "
                f"channels_last {res[False]['nhwc']:.2f} ms | benchmark on: nchw "
                f"{res[True]['nchw']:.2f}, channels_last {res[True]['nhwc']:.2f} | fp32 no-TF32:"
                f" eager {tm['eager']:.2f}, middleware {tm['middleware']:.2f} ms, "
                f"err {err:.1e}, runs_as {counts}",
                flush=True,
            )


if __name__ == "__main__":
    main()
