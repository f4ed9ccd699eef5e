"""``p2psync demo``: a GRPO run on one machine with a trainer, relays and rollout nodes as local processes.

The trainer process warms a 19M-parameter Qwen3-shaped model up on the task
(version 0, shipped as a snapshot), then runs GRPO at an RL learning rate and
publishes every step as a signed sparse delta; the coordinator plans a tree
that enters each region once, through its relay; rollout nodes apply each
delta to their engines and generate the next rollouts, which stream back to
the trainer under leases. A live dashboard shows the run; at the end a report
(an HTML page with its figures, and ``summary.json``) is written under
``--out``. Exits non-zero if any node or rollout engine ever held a fingerprint
different from the trainer's for the same version, if a node did not reach the
last version, or if a process failed. ``--quick``: a tiny model, a few steps.

``p2psync demo --codec`` runs the earlier single-process codec demonstration.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="end-to-end GRPO run: trainer, relays and rollout nodes as local processes",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small and fast (for tests): a 0.5M-parameter model from scratch at lr 1e-2, 4 steps, "
                        "one rollout node per region; options given explicitly still win")
    p.add_argument("--steps", type=int, default=None, help="RL optimizer steps (default 60; --quick 4)")
    p.add_argument("--regions", type=int, default=2, help="emulated regions (default 2)")
    p.add_argument("--rollouts-per-region", type=int, default=None,
                   help="rollout nodes per region (default 2; --quick 1)")
    p.add_argument("--relays-per-region", type=int, default=1, help="relays per region (default 1)")
    p.add_argument("--model-path", help="local Hugging Face model folder instead of a built-in preset")
    p.add_argument("--model-preset", dest="preset_e2e", default=None,
                   help="random-init model preset of trainer.workload (default demo: 19M parameters, 38 MB in "
                        "bf16; --quick: mini)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="rollout engine (default hf: transformers; vllm: vLLM 0.32 through the p2psync weight-transfer "
                        "backend; the demo preset's head_dim 64 runs on vLLM's CPU attention)")
    p.add_argument("--task", default=None, help="reward task (see trainer.tasks; default add_small)")
    p.add_argument("--group-size", type=int, default=None, help="responses per prompt (default 8)")
    p.add_argument("--groups-per-step", type=int, default=None, help="prompt groups per optimizer step")
    p.add_argument("--lr", type=float, default=None, help="RL learning rate (default 7.5e-5; --quick 1e-2)")
    p.add_argument("--adam-eps", type=float, default=None,
                   help="AdamW epsilon (default 1e-3: the step follows the gradient's size; --quick 1e-8)")
    p.add_argument("--reward", choices=("shaped", "exact"), default=None,
                   help="exact: 1 for the exact answer, else 0 (default); shaped: partial credit (--quick)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    p.add_argument("--warm-start-steps", type=int, default=None,
                   help="supervised steps on the task before version 0 (default 40; --quick 0)")
    p.add_argument("--warm-start-noise", type=float, default=None,
                   help="share of warm-start demonstrations that are wrong (default 0.5; --quick 0)")
    p.add_argument("--max-staleness", type=int, default=1, help="versions a rollout may lag (default 1)")
    p.add_argument("--switch", choices=("step", "batch"), default="step",
                   help="when a rollout node takes a new version: between decode steps (default: fresher tokens; "
                        "the transformers engine then re-prefills the running batch under the new weights) or "
                        "only between batches (no re-prefill, but a version waits for the batch to end)")
    p.add_argument("--publish-first", choices=("auto", "on", "off"), default="auto",
                   help="announce each version before the next step's training starts (auto: on when "
                        "--max-staleness <= 1, where the next-but-one batch waits for that version)")
    p.add_argument("--no-sync", action="store_true",
                   help="do not publish after step 0 (rollouts keep the initial weights: the no-sync baseline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1",
                   help="loopback address the nodes listen on (default 127.0.0.1; any 127.x.y.z, e.g. to capture "
                        "only the demo's traffic)")
    p.add_argument("--capture", metavar="DIR",
                   help="record every byte between the nodes (a relay in front of each node) into DIR/<node>.bin")
    p.add_argument("--out", default="p2psync-demo", help="working directory (default ./p2psync-demo)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    p.add_argument("--plain", action="store_true", help="one line per step instead of the live dashboard")
    p.add_argument("--codec", action="store_true",
                   help="run the single-process codec demonstration instead (options below)")
    g = p.add_argument_group("codec demonstration (--codec)")
    g.add_argument("--preset", default="small", help="model size: tiny, small, bench (default small)")
    g.add_argument("--chunk-size", default="1MiB", help="artifact chunk size (default 1MiB)")
    g.add_argument("--threads", type=int, default=2)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.codec:
        from demo.codec import run_codec

        if args.lr is None:
            args.lr = 1e-6
        if args.steps is None:
            args.steps = 30
        return run_codec(args)
    from demo.run import run_demo

    return run_demo(args)
