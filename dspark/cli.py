"""The `dspark` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from dspark.config import ServeConfig
from dspark.sampling_params import SamplingParams

_PACKAGE = Path(__file__).resolve().parent


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target HF directory (default: the shipped demo target)")
    p.add_argument("--proposer", choices=["dspark", "draft-model", "ngram", "none"], default=None)
    p.add_argument("--drafter", help="draft checkpoint directory (default: the shipped demo one)")
    p.add_argument("--policy", choices=["off", "fixed", "equal", "confidence-sync", "confidence"],
                   default=None)
    p.add_argument("--k", type=int, default=None, help="drafts per request (fixed) / block size")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32")
    _device_arg(p)


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="in-process workers: cpu, cuda or cuda:N (default: CUDA if any)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, max_tokens=a.max_tokens,
        seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos,
    )


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default=None,
                   help="with --server: file holding the bearer token (else $DSPARK_AUTH_TOKEN)")
    p.add_argument("--tls", action="store_true", help="with --server: TLS with the system roots")
    p.add_argument("--ca-file", default=None, help="with --server: PEM roots to trust (TLS)")
    p.add_argument("--client-cert-file", default=None, help="with --server: mutual TLS chain")
    p.add_argument("--client-key-file", default=None, help="with --server: mutual TLS key")


def _client_security(a: argparse.Namespace) -> dict[str, Any]:
    """Client keyword arguments from the generate flags; unreadable files fail by name."""
    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    token = None
    if a.token_file is not None:
        lines = Path(a.token_file).read_text().split()
        if not lines:
            raise ValueError(f"--token-file {a.token_file}: empty")
        token = lines[0]
    return {"token": token, "tls": a.tls, "root_certificates": read(a.ca_file),
            "private_key": read(a.client_key_file),
            "certificate_chain": read(a.client_cert_file)}


def _engine(a: argparse.Namespace):  # noqa: ANN202 - Engine imported lazily (torch start-up)
    import torch

    from dspark.coordinator.engine import Engine

    return Engine(
        target=a.target, proposer=a.proposer, drafter=a.drafter, policy=a.policy, k=a.k,
        dtype=getattr(torch, a.dtype), device=a.device,
    )


def cmd_generate(a: argparse.Namespace) -> int:
    if a.server:
        from dspark.client import Client
        from dspark.errors import DSparkError

        try:
            with Client(a.server, timeout=a.timeout, **_client_security(a)) as client:
                out = client.generate(a.prompt, _params(a))
        except DSparkError as e:
            if isinstance(e, ValueError):
                raise
            print(f"dspark: error: {e}", file=sys.stderr)
            return 1
    else:
        out = _engine(a).generate([a.prompt], _params(a))[0]
    if a.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text,
                          "finish_reason": out.finish_reason, "stats": out.stats}))
    else:
        print(a.prompt + out.text)
        print(f"\n[{out.finish_reason}] {len(out.token_ids)} tokens, "
              f"mean accepted length {out.stats['mean_accepted_length']}", file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import signal
    import threading

    from dspark.coordinator.serve import start_service

    service = start_service(ServeConfig.from_arguments(a))
    print(f"dspark: serving on {service.address} ({service.mode} engine, proposer "
          f"{service.config.proposer}, policy {service.engine.policy.name})", flush=True)
    if service.metrics_port is not None:
        print(f"dspark: metrics on http://{service.config.host}:{service.metrics_port}/metrics",
              flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    # SIGTERM (Kubernetes, systemd) or SIGINT: drain. Health turns NOT_SERVING and new calls
    # get UNAVAILABLE at once; calls in flight get the grace period to finish, then exit 0.
    servicer = service.server.servicer
    print(f"dspark: stopping: draining {servicer.in_flight if servicer else 0} calls in flight "
          f"(grace {service.config.grace:g} s)", flush=True)
    service.stop()
    print("dspark: stopped", flush=True)
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from dspark.bench import run_demo

    run_demo(num_prompts=a.num_prompts, max_tokens=a.max_tokens, in_process=a.in_process)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from dspark.bench import run_core_bench

    run_core_bench(num_prompts=a.num_prompts, max_tokens=a.max_tokens, out_dir=Path(a.out))
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from dspark.coordinator.engine import Engine
    from dspark.coordinator.profiler import plot, profile_workers

    engine = Engine(target=a.target, proposer=a.proposer, drafter=a.drafter, policy="fixed",
                    device=a.device)
    proposer = None if a.proposer == "none" else engine.proposer
    cost = profile_workers(engine.target, proposer, b_max=a.b_max, n_max=a.n_max,
                           repeats=a.repeats, device=engine.target.device)
    out = Path(a.out)
    cost.save(out / "cost_model.json")
    plot(cost, out / "cost_model.png")
    print(f"wrote {out / 'cost_model.json'} and {out / 'cost_model.png'}")
    return 0


def cmd_bench_policies(a: argparse.Namespace) -> int:
    from dspark.bench import run_policy_bench

    concs = tuple(int(c) for c in a.concurrency.split(","))
    temps = tuple(float(t) for t in a.temperatures.split(","))
    arms = tuple(a.arms.split(",")) if a.arms else None
    workers = None
    if a.draft_actors:
        from dspark.coordinator.ray_workers import build_ray_workers, shutdown

        workers = build_ray_workers(proposer=a.proposer, num_draft_actors=a.draft_actors)
    try:
        run_policy_bench(proposer=a.proposer, concurrencies=concs, temperatures=temps,
                         max_tokens=a.max_tokens, out_dir=Path(a.out), repeats=a.repeats,
                         arms=arms, trace_dir=Path(a.trace_dir) if a.trace_dir else None,
                         workers=workers, device=a.device)
    finally:
        if workers is not None:
            shutdown(workers, stop_ray=True)
    return 0


def cmd_trace_summary(a: argparse.Namespace) -> int:
    from dspark.coordinator.trace import format_budget_rows, read_trace

    for path in a.traces:
        try:
            trace = read_trace(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: {getattr(e, 'strerror', None) or e}") from e
        meta = " ".join(f"{k}={v}" for k, v in trace.meta.items())
        print(f"== {path}" + (f" ({meta})" if meta else ""))
        print(format_budget_rows(trace))
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from dspark.coordinator.sim.cli import main as simulate_main

    return simulate_main(a)


def cmd_demo_path(a: argparse.Namespace) -> int:
    from dspark.demo import demo_path

    print(demo_path(a.name))
    return 0


def cmd_train_tokenizer(a: argparse.Namespace) -> int:
    from dspark.training.tokenizer_training import train_tokenizer

    print(train_tokenizer(a.out, a.vocab_size))
    return 0


def cmd_train_target(a: argparse.Namespace) -> int:
    from dspark.training.lm_training import TrainConfig, train_lm

    cfg = TrainConfig(preset=a.preset, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len,
                      lr=a.lr, seed=a.seed)
    log = train_lm(a.tokenizer, a.out, cfg)
    if a.log_dir:
        _write_training_log(log, Path(a.log_dir))
    print(
        json.dumps({k: log[k] for k in ("preset", "num_params", "held_out_loss", "train_seconds")})
    )
    return 0


def cmd_train_demo(a: argparse.Namespace) -> int:
    """Retrain every shipped demo artefact into the package's demo folder."""
    from dspark.training.lm_training import TrainConfig, train_lm
    from dspark.training.prompts import make_heldout_prompts
    from dspark.training.tokenizer_training import train_tokenizer

    demo = _PACKAGE / "demo"
    tok = train_tokenizer(Path(a.work_dir) / "tokenizer")
    make_heldout_prompts(demo / "heldout_prompts.jsonl")
    for preset, steps in (("draft-model", 1500), ("target", 1200)):
        log = train_lm(tok, demo / preset, TrainConfig(preset=preset, steps=steps))
        _write_training_log(log, Path(a.work_dir))
    _train_demo_drafter(demo, Path(a.work_dir))
    return 0


# The shipped DSpark drafter's recipe (see its training_log.json): a first run on corpus text,
# a longer one from its weights with a fresh schedule, a third from those with half of every
# step's windows the target's own T = 1 continuations, then STS.
DEMO_DRAFTER_STEPS = (850, 6000, 4000)


def _train_demo_drafter(demo: Path, work_dir: Path) -> None:
    import shutil

    from dspark.training.calibration import calibrate
    from dspark.training.drafter_training import DrafterTrainConfig, train_drafter

    first, second, final = (work_dir / n for n in ("dspark-first", "dspark-second", "dspark"))
    train_drafter(demo / "target", first, DrafterTrainConfig(steps=DEMO_DRAFTER_STEPS[0]))
    train_drafter(demo / "target", second, DrafterTrainConfig(
        steps=DEMO_DRAFTER_STEPS[1], eval_every=500, init_from=str(first)))
    train_drafter(demo / "target", final, DrafterTrainConfig(
        steps=DEMO_DRAFTER_STEPS[2], eval_every=500, warmup=20, sampled_fraction=0.5,
        init_from=str(second)))
    calibrate(final, demo / "target", plot=final / "reliability.png")
    (demo / "dspark").mkdir(exist_ok=True)
    for f in final.iterdir():
        if f.is_file():
            shutil.copy(f, demo / "dspark" / f.name)


def cmd_train_drafter(a: argparse.Namespace) -> int:
    """Train a DSpark drafter online against its target (resumes from OUT/train_state)."""
    import torch

    from dspark.training.drafter_training import DrafterTrainConfig, train_drafter

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = DrafterTrainConfig(
        steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, num_anchors=a.num_anchors,
        block_size=a.block_size, num_draft_layers=a.num_draft_layers,
        target_layer_ids=tuple(a.target_layer_ids), markov_rank=a.markov_rank, lr=a.lr,
        eval_every=a.eval_every, seed=a.seed, init_from=a.init_from,
        sampled_fraction=a.sampled_fraction, warmup=a.warmup,
    )
    log = train_drafter(a.target, a.out, cfg, resume=not a.no_resume)
    print(
        json.dumps(
            {
                "out": a.out,
                "train_seconds": log["train_seconds"],
                "final": log["train"][-1],
                "held_out": log["eval"][-1] if log["eval"] else None,
            }
        )
    )
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    """Fit STS temperatures on held-out data and store them in the drafter's config.json."""
    from dspark.training.calibration import calibrate, print_table

    plot = a.plot or str(Path(a.drafter) / "reliability.png")
    report = calibrate(a.drafter, a.target, num_windows=a.num_windows, temperature=a.temperature,
                       seed=a.seed, plot=plot, write=not a.dry_run)
    print_table(report)
    print(f"reliability diagram: {plot}")
    return 0


def _write_training_log(log: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{log['preset']}_log.json").write_text(json.dumps(log) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(log["train_loss"], lw=0.6, label="train (batch)")
    ax.plot([e["step"] for e in log["eval"]], [e["held_out_loss"] for e in log["eval"]], "o-",
            label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{log['preset']}: {log['num_params'] / 1e6:.1f} M params")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / f"{log['preset']}_loss.png", dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--server", default=None,
                   help="generate on the dspark server at HOST:PORT (engine options are ignored)")
    p.add_argument("--timeout", type=float, default=None, help="with --server: deadline in seconds")
    _client_args(p)
    _engine_args(p)
    _sampling_args(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("serve", help="serve the gRPC API (default: local Ray, the demo models)")
    ServeConfig.add_arguments(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("demo", help="the main job: demo models, a few prompts, a speed summary")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--in-process", action="store_true", help="serve without Ray")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("bench", help="core benchmark: proposers side by side, T=0 and T=1")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", default="runs/bench_core")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("bench-policies", help="policies side by side across requests in flight")
    p.add_argument("--proposer", choices=["dspark", "draft-model", "ngram"], default="dspark")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument(
        "--arms", help="comma-separated arm labels (default: all), e.g. 'off,fixed k=7,confidence'"
    )
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved rounds per cell (median); 1 and 4 in flight run 4x and 2x as many",
    )
    p.add_argument("--out", default="runs/bench_policies")
    p.add_argument("--trace-dir", help="also write each arm's step trace per cell there "
                   "(summarise with `dspark trace-summary`)")
    p.add_argument("--draft-actors", type=int, default=0,
                   help="run every arm over Ray worker pools (a local instance: a tp = 1 target "
                   "group and this many draft actors, shared by the arms); 0: in process")
    _device_arg(p)
    p.set_defaults(fn=cmd_bench_policies)

    p = sub.add_parser("trace-summary",
                       help="a step trace's time by kind of step: prompts, and decode steps by K")
    p.add_argument("traces", nargs="+", help="trace files (JSON lines, coordinator/trace.py)")
    p.set_defaults(fn=cmd_trace_summary)

    p = sub.add_parser("profile", help="measure the step-cost model (verify and draft) and plot it")
    p.add_argument("--target")
    p.add_argument("--proposer", choices=["dspark", "draft-model", "ngram", "none"],
                   default="dspark", help="whose drafting rounds are timed")
    p.add_argument("--drafter")
    p.add_argument("--b-max", type=int, default=128)
    p.add_argument("--n-max", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="runs/profile")
    _device_arg(p)
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("simulate", help="simulate a fleet: policies across load (docs/scale.md)")
    from dspark.coordinator.sim.cli import add_arguments as simulate_arguments

    simulate_arguments(p)
    p.set_defaults(fn=cmd_simulate)

    p = sub.add_parser("demo-path", help="print the directory of a shipped demo checkpoint")
    p.add_argument("name", choices=["target", "draft-model", "dspark"])
    p.set_defaults(fn=cmd_demo_path)

    p = sub.add_parser("train-tokenizer", help="train the byte-level BPE on the stdlib source")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.set_defaults(fn=cmd_train_tokenizer)

    p = sub.add_parser("train-target", help="train a demo LM (the target or the draft model)")
    p.add_argument("--preset", choices=["target", "draft-model"], default="target")
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="write the loss log (JSON) and curve (PNG)")
    p.set_defaults(fn=cmd_train_target)

    p = sub.add_parser("train-demo", help="retrain all shipped demo artefacts (~3 h on 2 cores)")
    p.add_argument("--work-dir", default="runs/train-demo")
    p.set_defaults(fn=cmd_train_demo)

    p = sub.add_parser("train-drafter", help="train a DSpark drafter online against its target")
    p.add_argument("--target", required=True, help="target HF directory (with its tokenizer)")
    p.add_argument(
        "--out", required=True, help="drafter directory (resumable state in OUT/train_state)"
    )
    p.add_argument("--steps", type=int, default=850)
    p.add_argument("--batch-size", type=int, default=8, help="token windows per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--num-anchors", type=int, default=32, help="blocks per window")
    p.add_argument("--block-size", type=int, default=7, help="γ, drafts per block")
    p.add_argument("--num-draft-layers", type=int, default=2)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 3, 5])
    p.add_argument("--markov-rank", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--sampled-fraction", type=float, default=0.0,
                   help="share of windows from the target's own T=1 continuations")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-resume", action="store_true", help="start afresh even if state exists")
    p.add_argument("--init-from", default=None,
                   help="start from this drafter's weights (same shapes; schedule starts afresh)")
    p.set_defaults(fn=cmd_train_drafter)

    p = sub.add_parser(
        "calibrate", help="fit STS temperatures of a DSpark drafter's confidence head"
    )
    p.add_argument("--drafter", required=True)
    p.add_argument("--target", required=True)
    p.add_argument(
        "--num-windows", type=int, default=768, help="held-out windows per split (x8 blocks)"
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature of the blocks"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plot", default=None, help="reliability diagram PNG (default DRAFTER/reliability.png)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="report only; leave config.json unchanged"
    )
    p.set_defaults(fn=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ValueError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
