"""``zerotrain plan``: the config that fits and is fastest for a model on this machine, from
the cost model (zerotrain/plan/) and a probe of the machine; ``--verify`` runs the top ones."""

from __future__ import annotations

import argparse
import json
import os
import sys

from zerotrain.cli.arguments import ParserSpec, non_negative_int, positive_int

__all__ = ["PARSER", "add_arguments"]

DEFAULT_OUT = "ds_config.plan.json"

PARSER: ParserSpec = {
    "help": "choose the ZeRO config that fits and trains fastest, from a probe of this machine",
    "description": "Enumerates tensor- and (for transformers causal LMs) sequence-parallel "
    "degree (and with --pipeline the pipeline degree), ZeRO stage, optimizer offload, "
    "activation checkpointing and micro-batch for the model and global batch, predicts each "
    "one's peak memory per rank and step time on this machine (measured rates, cached), drops "
    "those that do not fit, and writes the fastest as a ds_config. See docs/plan.md.",
}


def _read_base(args: argparse.Namespace) -> dict:
    """The --config file's ds_config, checked against the other flags (PlanError)."""
    from zerotrain.plan.autotuning import read_autotuning
    from zerotrain.plan.candidates import enumerate_candidates, fixed_keys, section
    from zerotrain.plan.planner import PlanError, check_candidates

    base: object = {}
    if args.config:
        try:
            with open(args.config) as file:
                base = json.load(file)
        except (OSError, ValueError) as error:
            raise PlanError(f"--config: cannot read {args.config}: {error}") from error
        if not isinstance(base, dict):
            raise PlanError(f"--config: {args.config} holds no JSON object")
    assert isinstance(base, dict)
    batch = base.get("train_batch_size")
    batch = batch if isinstance(batch, int) else None  # "auto" and absent leave it free
    if args.global_batch is None:
        if batch is None:
            raise PlanError(
                "give --global-batch (samples per optimizer step over all ranks), or "
                "train_batch_size in --config"
            )
        args.global_batch = batch
    elif batch is not None and batch != args.global_batch:
        raise PlanError(
            f"--config sets train_batch_size {batch}, --global-batch {args.global_batch}: give "
            "one of them, or the same number"
        )
    try:
        args.tuning = read_autotuning(base)
        args.tuning.check_global_batch(args.global_batch)
    except ValueError as error:
        raise PlanError(f"--config: {error}") from error
    if args.out is None:
        results = args.tuning.results_dir
        args.out = os.path.join(results, "ds_config_optimal.json") if results else DEFAULT_OUT
    offload = section(section(base, "zero_optimization"), "offload_optimizer")
    args.nvme_path = args.nvme_path or offload.get("nvme_path")
    if offload.get("device") == "nvme" and not args.nvme_path:
        raise PlanError(
            "--config offloads to nvme without an nvme_path: give --nvme-path (the probe "
            "measures that disk)"
        )
    args.tp_degrees = _tensor_degrees(args, base)
    fixed_sp = fixed_keys(base).get("sp", 1)
    if _ranks(args) % fixed_sp:
        raise PlanError(
            f"--config sets sequence_parallel_size {fixed_sp}: the planner keeps a sample's "
            f"sequence-parallel ranks on one node, and a node here has {_ranks(args)}"
        )
    # initialize's config check over the candidates, before anything is probed
    candidates = enumerate_candidates(
        world=_ranks(args) * args.nnodes,
        global_batch=args.global_batch,
        base=base,
        nvme=args.nvme_path is not None,
        tp_degrees=args.tp_degrees,
        sp_degrees=(fixed_keys(base).get("sp", 1),),
    )
    check_candidates(candidates, base, args.nvme_path)
    return base


def _tensor_degrees(args: argparse.Namespace, base: dict) -> tuple[int, ...]:
    """The tensor-parallel degrees to weigh: within a node, the one ``base`` fixes if it does,
    and only those whose data-parallel ranks share the global batch (PlanError if none)."""
    from zerotrain.plan.candidates import batch_sharing_degrees, fixed_keys, section
    from zerotrain.plan.planner import PlanError, tensor_degrees

    ranks = _ranks(args)
    world = ranks * args.nnodes
    tensor = section(base, "tensor_parallel")
    if tensor.get("tp_plan") is not None or tensor.get("sequence_parallel"):
        raise PlanError(
            "--config: the planner prices tensor parallelism by the automatic plan without "
            "sequence parallelism; remove tensor_parallel.tp_plan and sequence_parallel to plan"
        )
    degrees = tensor_degrees(ranks)
    # initialize refuses tensor parallelism with these (zerotrain/tensor_parallel); the
    # planner does not combine it with sequence parallelism
    if (
        section(base, "optimizer").get("type") == "Muon"
        or section(base, "lora_fa").get("enabled")
        or fixed_keys(base).get("sp", 1) > 1
    ):
        degrees = (1,)
    fixed = fixed_keys(base).get("tp")
    if fixed is not None:
        if fixed not in degrees:
            raise PlanError(
                f"--config fixes tensor-parallel degree {fixed} (tensor_parallel.autotp_size or "
                f"autotuning.mp_size); the planner weighs degrees {list(degrees)} here (peers on "
                f"one node of {ranks} ranks; none above 1 with Muon or LoRA-FA)"
            )
        degrees = (fixed,)
    shared = batch_sharing_degrees(degrees, world=world, global_batch=args.global_batch)
    if not shared:
        raise PlanError(
            f"--global-batch {args.global_batch} is not a multiple of the "
            f"{' or '.join(str(world // d) for d in degrees)} data-parallel ranks"
        )
    return shared


def _sequence_degrees(args: argparse.Namespace, base: dict, model) -> tuple[int, ...]:
    """The sequence-parallel degrees to weigh for a transformers causal LM (others have no
    attention Ulysses registers in): above 1, within a node, whose data-parallel ranks share
    the global batch; none where ``base`` fixes tensor parallelism, which the planner does not
    combine with it; the one ``base`` fixes if it does (the model facts then say why it cannot
    be planned, if so)."""
    from zerotrain.plan.candidates import fixed_keys, shares_batch
    from zerotrain.plan.model_probe import is_hf_causal_lm

    fixed = fixed_keys(base)
    if fixed.get("sp", 1) > 1:  # planned or refused, with the reason
        return (fixed["sp"],)
    if not is_hf_causal_lm(model) or fixed.get("tp", 1) > 1:
        return ()
    ranks, world = _ranks(args), _ranks(args) * args.nnodes
    return tuple(
        d
        for d in range(2, ranks + 1)
        if ranks % d == 0
        and fixed.get("sp", d) == d
        and shares_batch(d, world=world, global_batch=args.global_batch)
    )


def _pipeline_degrees(args: argparse.Namespace, base: dict, world: int, say) -> tuple[int, ...]:
    """The pipeline degrees ``--pipeline`` weighs: those above 1 that divide the ranks and
    leave data-parallel ranks that share the global batch; none (``say`` tells why) where
    ``base`` fixes what no pipeline candidate is (see docs/plan.md, "Pipelines")."""
    from zerotrain.plan.candidates import fixed_keys, section, shares_batch

    fixed = fixed_keys(base)
    schedule = section(base, "pipeline").get("schedule", "1f1b")
    why = None
    if fixed.get("stage") == 3:
        why = "--config fixes ZeRO stage 3, which a pipeline refuses"
    elif fixed.get("activation_checkpointing"):
        why = "--config checkpoints activations, which the planner does not price in a pipeline"
    elif fixed.get("tp", 1) > 1:
        why = "--config fixes tensor parallelism, which the planner does not combine with one"
    elif fixed.get("sp", 1) > 1:
        why = "--config sets sequence_parallel_size, which a pipeline refuses"
    elif section(base, "torch_autocast").get("enabled"):
        why = "--config enables torch_autocast, which a pipeline refuses"
    elif any(section(base, "tiled_compute").get(key) for key in ("mlp", "loss")):
        why = (
            "--config tiles compute (tiled_compute), which the planner does not price in a pipeline"
        )
    elif schedule != "1f1b":
        why = f"--config asks for pipeline.schedule {schedule}; the planner prices 1f1b"
    if why:
        say(f"pipelines not planned: {why}")
        return ()
    return tuple(
        d
        for d in range(2, world + 1)
        if shares_batch(d, world=world, global_batch=args.global_batch)
    )


def _tiles(base: dict, spec: str):
    """The ``tiled_compute`` section of ``base`` where it tiles anything (None otherwise),
    checked against the model of ``spec`` (built on the meta device: the tiles change the
    model they tile) as ``initialize`` would apply it (PlanError where it would refuse)."""
    from zerotrain.config import ConfigError, check_config
    from zerotrain.estimate.factory import build_on_meta
    from zerotrain.plan.candidates import section
    from zerotrain.plan.planner import PlanError
    from zerotrain.plan.sequence_share import tile_alone

    tiles = check_config({"tiled_compute": section(base, "tiled_compute")}).tiled_compute
    if not (tiles.mlp or tiles.loss):
        return None
    try:
        tile_alone(build_on_meta(spec), tiles)
    except (ConfigError, ValueError) as error:
        raise PlanError(f"--config: {error}") from error
    return tiles


def _ranks(args: argparse.Namespace) -> int:
    return args.nproc_per_node or args.gpus_per_node or 1


def _plan_command(args: argparse.Namespace, rest: list[str]) -> int:
    from zerotrain.estimate.factory import ModelFactoryError, build_on_meta, load_factory
    from zerotrain.plan.candidates import fixed_keys, micro_batches, training_dtype
    from zerotrain.plan.jobs import JobError
    from zerotrain.plan.planner import (
        MOE_ALONE,
        WHOLE_MODEL,
        PlanError,
        load_corrections,
        make_plan,
        model_facts,
        with_compression,
        with_optimizer,
        with_profiles,
    )
    from zerotrain.plan.probe import probe_machine, with_current_memory
    from zerotrain.zero.swap import SwapIOError

    def fail(message: str, code: int = 2) -> int:
        print(f"zerotrain plan: {message}", file=sys.stderr)
        return code

    def say(text: str) -> None:
        print(f"zerotrain plan: {text}", file=sys.stderr, flush=True)

    ranks = _ranks(args)
    world = ranks * args.nnodes
    if args.verify and args.nnodes > 1:
        return fail("--verify runs the trials on this node; it needs --nnodes 1")
    try:
        base = _read_base(args)
        model = build_on_meta(args.model)
        tiles = _tiles(base, args.model)
    except (PlanError, ModelFactoryError) as error:
        return fail(str(error))
    for note in args.tuning.notes:
        say(note)
    dtype = training_dtype(base)
    unplanned = {}
    fixed_sp = fixed_keys(base).get("sp", 1)

    def skipped(what: str, why: str) -> None:
        unplanned[what] = why
        if what != f"sequence parallelism at degree {fixed_sp}":  # refused below, with why
            say(f"{what} not planned: {why}")

    facts = model_facts(
        model,
        seq_len=args.seq_len,
        dtype=dtype,
        tp_degrees=args.tp_degrees,
        sp_degrees=_sequence_degrees(args, base, model),
        skipped=skipped,
    )
    if fixed_sp > 1 and fixed_sp not in facts.sequences:
        why = unplanned.get(f"sequence parallelism at degree {fixed_sp}", "")
        return fail(f"--config sets sequence_parallel_size {fixed_sp}, not planned here: {why}")
    try:
        machine = probe_machine(
            dtype=dtype,
            world=ranks,
            nvme_path=args.nvme_path,
            refresh=args.reprobe,
            progress=lambda text: say(f"probing this machine: {text}"),
        )
    except (JobError, OSError, SwapIOError) as error:
        return fail(f"the machine probe failed: {error}", 1)
    machine = with_current_memory(machine)
    try:
        facts = with_optimizer(facts, base, machine.threads)
    except (ValueError, TypeError) as error:  # the optimizer's own check of its params
        return fail(f"--config: {error}")
    facts = with_compression(facts, model, base, machine)
    vocab = args.vocab_size or facts.count.config.get("vocab_size")
    pipelines = ()
    if args.pipeline and facts.experts is not None:
        say(f"pipelines not planned: {MOE_ALONE}")
    elif args.pipeline:
        pipelines = _pipeline_degrees(args, base, world, say)
    if args.pipeline and not vocab:
        say("--pipeline needs --vocab-size (the model has no config that says it): not planned")
    if vocab:
        # a fixed degree above 1 leaves the whole model unused
        whole = 1 in args.tp_degrees and fixed_keys(base).get("sp", 1) == 1
        timed = ["whole"] * whole + [
            f"tensor-parallel share at {tp}" for tp in sorted(facts.shares)
        ]
        timed += [f"cut into {pp} pipeline stages" for pp in pipelines]
        timed += [f"sequence-parallel share at {sp}" for sp in sorted(facts.sequences)]
        say(f"timing the model's forward and backward: {', '.join(timed)}")

        def failed(what: str, why: str) -> None:
            if what == WHOLE_MODEL:
                say(f"the model probe failed ({why}); pricing by FLOPs")
            else:
                say(f"{what} not planned: {why}")

        def sizes(tp: int, pp: int, sp: int) -> list[int]:
            dp = world // (tp * pp * sp)
            return micro_batches(
                world=dp, global_batch=args.global_batch, base=base, pipeline_stages=pp
            )

        facts = with_profiles(
            load_factory(args.model),
            facts,
            machine,
            sizes=sizes,
            vocab=vocab,
            failed=failed,
            whole=whole,
            pipeline_degrees=pipelines,
            tiles=tiles,
        )
    try:
        plan = make_plan(
            facts,
            machine,
            world=world,
            ranks_per_node=ranks,
            global_batch=args.global_batch,
            base=base,
            nvme_path=args.nvme_path,
            corrections=load_corrections(machine),
        )
    except PlanError as error:
        return fail(str(error))
    for what in plan.unpriced:
        say(f"not priced: {what}")
    if plan.refused:
        label, why = plan.refused[0]
        say(
            f"{len(plan.refused)} candidate config(s) left out, which initialize would refuse "
            f"(--json lists them); {label}: {why.splitlines()[0]}"
        )
    if args.verify:
        _verify(plan, args, facts, machine, vocab, say)
    if args.out:
        try:
            if os.path.dirname(args.out):
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as out:
                json.dump(plan.best.config, out, indent=2)
        except OSError as error:
            return fail(f"--out: cannot write {args.out}: {error}", 1)
    if args.json:
        print(json.dumps(plan.as_json(), indent=1))
    else:
        print(_table(plan, args.top))
        if args.out:
            print(f"wrote the chosen config to {args.out}")
        pipeline = plan.best.pipeline()
        if pipeline:
            print(
                f"the chosen config trains the model as a pipeline of {pipeline['stages']} "
                f"stages: zerotrain.pipe.split_model(model, (one micro-batch of ids,), "
                f"{pipeline['split_points']}, loss_fn), trained with engine.train_batch "
                "(docs/parallelism.md)"
            )
    return 0


def _verify(plan, args: argparse.Namespace, facts, machine, vocab, say) -> None:
    """Run the top ``--verify`` candidates, attach what they measured (or why a trial failed),
    and refine the machine's corrections with the ones that ran."""
    from zerotrain.plan.jobs import JobError
    from zerotrain.plan.planner import refine, save_corrections
    from zerotrain.plan_trial import TrialSpec, run_trial

    if not vocab:
        say("--verify needs --vocab-size (the model has no config that says it): not run")
        return
    pairs = []
    for planned in plan.ranked()[: args.verify]:
        say(f"verifying {planned.candidate.label()} ...")
        spec = TrialSpec(
            model=args.model,
            config=planned.config,
            world=planned.candidate.world,
            seq_len=args.seq_len,
            vocab_size=vocab,
            activation_checkpointing=planned.candidate.activation_checkpointing,
            split_points=planned.candidate.split_points,
            steps=args.tuning.end_profile_step,
            first_timed=args.tuning.start_profile_step,
            env={"OMP_NUM_THREADS": str(machine.threads)},  # what the prediction assumed
        )
        try:
            planned.measured = run_trial(spec).as_dict()
        except JobError as error:
            say(f"the trial of {planned.candidate.label()} failed: {error}")
            planned.measured = {"error": str(error)}
            continue
        pairs.append((planned.predicted, planned.measured))
    if pairs:
        plan.corrections = refine(plan.corrections, pairs)
        save_corrections(machine, plan.corrections)


def _table(plan, top: int) -> str:
    from zerotrain.fmt import quantity

    lines = [
        f"{'':2}{'config':<52} {'peak/rank':>10} {'states':>10} {'step s':>8}  why",
    ]
    shown = plan.ranked()[:top]
    losers = [p for p in plan.candidates if not p.fits]
    if losers:
        shown.append(min(losers, key=lambda p: p.predicted.peak_memory_bytes))
    for planned in shown:
        p = planned.predicted
        mark = "*" if planned is plan.best else " "
        lines.append(
            f"{mark} {planned.candidate.label():<52} {quantity(p.peak_memory_bytes, 'B'):>10} "
            f"{quantity(p.model_state_bytes, 'B'):>10} {p.step_time_s:>8.3f}  {planned.reason}"
        )
        if planned.measured and "error" not in planned.measured:
            m = planned.measured
            lines.append(
                f"  {'  measured':<52} {quantity(m['peak_memory_bytes'], 'B'):>10} "
                f"{quantity(m['model_state_bytes'], 'B'):>10} {m['step_time_s']:>8.3f}"
            )
    fitting = len(plan.ranked())
    lines.append(
        f"{len(plan.candidates)} candidates, {fitting} fit in {quantity(plan.budget, 'B')} "
        f"per rank; * chosen"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``plan``'s arguments."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="module.path:factory or path/to/file.py:factory (as zerotrain estimate takes it): "
        "a model whose forward(ids, targets) returns the loss, or an HF causal LM",
    )
    parser.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sample")
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        help="samples per optimizer step over all ranks (default: --config's train_batch_size)",
    )
    parser.add_argument("--nproc-per-node", type=positive_int, help="ranks per node (default 1)")
    parser.add_argument(
        "--gpus-per-node", type=positive_int, help="the estimator's spelling of --nproc-per-node"
    )
    parser.add_argument("--nnodes", type=positive_int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--config",
        metavar="BASE.json",
        help="a ds_config whose keys stay fixed (a stage, an offload device, a micro-batch, "
        "the precision sections...); its DeepSpeed autotuning section bounds the search",
    )
    parser.add_argument(
        "--nvme-path", help="offers NVMe offload, with its working files here (and probes it)"
    )
    parser.add_argument(
        "--verify",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="run a few steps of the K fastest candidates, print predicted against measured, "
        "and refine the model's constants for the next plan on this machine",
    )
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
        help="the token ids of --verify and of the model probe (default: the model's)",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="weigh pipeline parallelism too: the model cut into stages at its blocks (it must "
        "trace as one graph and return logits from model(ids)); the script then trains it as "
        "zerotrain.pipe.split_model(...) with engine.train_batch",
    )
    parser.add_argument(
        "--out",
        help="where the chosen ds_config is written ('' for nowhere; default "
        f"{DEFAULT_OUT}, or ds_config_optimal.json in --config's autotuning.results_dir)",
    )
    parser.add_argument("--top", type=positive_int, default=5, help="rows to print (default 5)")
    parser.add_argument("--reprobe", action="store_true", help="measure the machine again")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(handler=_plan_command)
