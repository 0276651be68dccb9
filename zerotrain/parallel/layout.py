"""The parallel layout: which ranks hold which part of the model and see which data, decided
once, in one place.

[Note: the parallel layout]
``initialize`` builds one :class:`ParallelLayout` (:meth:`ParallelLayout.build`) from the
config, the model and the world; nothing else decides parallelism. Building it makes the mesh
(comm/mesh.py: pp, dp, ep, sp, tp) and transforms the model, always in this order:
1. LoRA-FA adapters replace the target layers (zerotrain/lora.py), before anything is split:
   the adapters are what trains, and they are split and placed like any layer;
2. MoE layers are placed over the expert-parallel axis (zerotrain/moe/placement.py);
3. tensor parallelism splits layers over the tp axis (zerotrain/tensor_parallel);
4. a PipelineModule's tied layers get a group over the stages holding them (zerotrain/pipe;
   the pipeline split itself happened when each rank built only its stages' layers);
5. long sequences (zerotrain/sequence): a causal LM's attention and loss for the sp axis, and
   the MLPs and loss tiled, over the layers as the steps before left them.
Then the rest asks the layout: the shard groups' specs (which ranks a group is partitioned
over: the data- and sequence-parallel ranks; what gradients are averaged over, which tensors'
gradients are summed across model-parallel ranks, the pipeline chunk of each parameter:
:meth:`shard_group_specs`), the
data-parallel group for the loader and the batch arithmetic (:attr:`dp`), and the whole
model's state dict (:meth:`full_state`). The engine and the checkpoint see it through
``checkpoint.protocol.ModelLayout`` and name no axis.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from zerotrain.comm import Communicator, Mesh
from zerotrain.comm.site_clusters import SiteTiers, cluster_sites, describe_links, probe_site_links
from zerotrain.config import ConfigError, ZeroTrainConfig
from zerotrain.lora import convert_to_lora_fa
from zerotrain.moe.layer import expert_tensors
from zerotrain.moe.placement import expert_parallel_degree, place_experts
from zerotrain.optim import Lamb
from zerotrain.optim.muon import Muon
from zerotrain.pipe.checks import check_tied_offload
from zerotrain.pipe.module import PipelineModule
from zerotrain.sequence.transform import apply_long_context, check_axes
from zerotrain.tensor_parallel import TensorParallel, from_config, is_split
from zerotrain.zero import GroupOptions
from zerotrain.zero.group import ModelParallel
from zerotrain.zero.host import local_ranks
from zerotrain.zero.init import owner_of, partitioned_over
from zerotrain.zero.layout import NamedParams
from zerotrain.zero.optimizer import ShardGroupSpec
from zerotrain.zero.outer_step import SiteOptions, fragments_of
from zerotrain.zero.work_split import WorkSplit


def model_stages(model: nn.Module) -> int:
    """The pipeline stages ``model`` is cut into (1: it is not a PipelineModule): known before
    the config, whose batch keys count the ranks over them."""
    return model.num_stages if isinstance(model, PipelineModule) else 1


@dataclass(frozen=True)
class ParallelLayout:
    """The mesh, the model it transformed, and what follows from them (see
    [Note: the parallel layout])."""

    mesh: Mesh
    model: nn.Module
    tensor_parallel: TensorParallel | None  # None: no layer is split
    # id(param) -> the group of a tied layer's copies on several pipeline stages
    tied: dict[int, Communicator] = field(default_factory=dict)
    # training across sites: the sites' shares of the batch (None: equal)
    work_split: WorkSplit | None = None
    # and the outer exchange's tiers over clusters of sites (None: one over every site)
    site_tiers: SiteTiers | None = None

    @classmethod
    def build(
        cls,
        model: nn.Module,
        cfg: ZeroTrainConfig,
        comm: Communicator,
        device: torch.device,
        *,
        optimizer: Any,
        model_parameters: Iterable[Any] | None,
        sequence_group: Communicator | None = None,
    ) -> tuple[ParallelLayout, Iterable[Any] | None]:
        """Transform ``model`` in place for ``cfg`` over the world ``comm`` and move it to
        ``device``; returns the layout and the parameters to train (``model_parameters``, or
        LoRA-FA's adapters in their place). ``sequence_group``: this rank's sequence-parallel
        group when the caller made it (DeepSpeed's mpu), which the mesh then uses."""
        sites = _sites(cfg, comm.world_size)
        if isinstance(model, PipelineModule):  # before anything takes its parameters
            _place_stages(model, sites, comm, optimizer, model_parameters)
        if cfg.lora_fa.enabled:
            model_parameters = convert_to_lora_fa(
                model, cfg.lora_fa, optimizer, model_parameters, comm.rank
            )
        model.to(device)
        pipelined = isinstance(model, PipelineModule)
        mesh = Mesh(
            comm,
            tp=cfg.tensor_parallel.autotp_size,
            pp=model_stages(model),
            ep=expert_parallel_degree(model, cfg, pipelined),
            sp=cfg.sequence_parallel_size,
            site=sites,
            given={"sp": sequence_group} if sequence_group is not None else None,
            timeouts=_axis_timeouts(cfg),
        )
        _check_init_partition(model, mesh)
        if mesh.sizes["site"] > 1:
            _start_sites_alike(model, mesh)
        check_axes(cfg, mesh.sizes)
        place_experts(model, cfg, mesh)
        tensor_parallel = from_config(model, cfg, mesh, mesh.axis("pp") if pipelined else None)
        tied = model.tie_across_stages(mesh) if isinstance(model, PipelineModule) else {}
        check_tied_offload(cfg, tied)
        apply_long_context(model, cfg, mesh)
        work_split = _work_split(cfg, mesh)
        tiers = _site_tiers(cfg, mesh)
        return cls(mesh, model, tensor_parallel, tied, work_split, tiers), model_parameters

    # -- what the loader, the batch arithmetic and DeepSpeed's queries ask -------------------
    @property
    def dp(self) -> Communicator:
        """The ranks that see different data, at every site: what the data is split by (and,
        at one site without sequence parallelism, what dense parameters are sharded over:
        :attr:`zero`)."""
        return self.mesh.data

    @property
    def sequence(self) -> Communicator:
        """The sequence-parallel group: the ranks that hold shares of the same samples."""
        return self.mesh.axis("sp")

    @property
    def zero(self) -> Communicator:
        """The ranks holding the same dense parameters, which ZeRO shards them over: the
        data-parallel group and its ranks' sequence-parallel peers."""
        return self.mesh.zero

    @property
    def stages(self) -> Communicator | None:
        """The pipeline stages (rank i runs stage i); None without a PipelineModule."""
        return self.mesh.axis("pp") if isinstance(self.model, PipelineModule) else None

    @property
    def split_rank(self) -> int:
        return 0 if self.tensor_parallel is None else self.tensor_parallel.comm.rank

    @property
    def split_degree(self) -> int:
        return 1 if self.tensor_parallel is None else self.tensor_parallel.size

    @property
    def replica(self) -> int:
        return self.mesh.coordinates(self.mesh.world.rank)["site"]

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data.world_size

    def state_source(self, saved_world_size: int) -> int | None:
        world = self.mesh.world
        per_site = world.world_size // self.mesh.sizes["site"]
        other_sites = saved_world_size != world.world_size and self.mesh.sizes["site"] > 1
        if other_sites and saved_world_size % per_site == 0:
            # sites of this size, another number of them: the outer steps' state goes on
            # (OuterStep.load_state_dict checks the shards' layout is this run's)
            return world.rank % per_site
        return world.rank if world.rank < saved_world_size else None

    def micro_batch(self, configured: int) -> int:
        return configured if self.work_split is None else self.work_split.micro_batch()

    @property
    def sequence_shares(self) -> int:
        return self.mesh.sizes["sp"]

    @property
    def whole_model_here(self) -> bool:
        return self.mesh.sizes["pp"] == 1 and self.mesh.sizes["ep"] == 1

    @property
    def frozen_on_every_rank(self) -> bool:
        return self.mesh.sizes["ep"] > 1  # experts are exchanged in full_state

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """That ``optimizer`` can step this layout's parameters."""
        if self.tensor_parallel is not None and isinstance(optimizer, Lamb):
            raise ConfigError(
                "optimizer: LAMB's trust ratio needs each parameter's whole norm, and tensor "
                "parallelism (tensor_parallel.autotp_size > 1) splits parameters; use Adam or "
                "AdamW"
            )
        if self.tensor_parallel is not None and isinstance(optimizer, Muon):
            # a Muon the script built (the config's is refused before the model is split)
            raise ConfigError(
                "optimizer: Muon orthogonalises whole matrices, and tensor parallelism "
                "(tensor_parallel.autotp_size > 1) splits them over ranks, which zerotrain does "
                "not gather for it yet; use Muon without tensor parallelism, or another optimizer"
            )

    # -- the shard groups ---------------------------------------------------------------------
    def shard_group_specs(
        self, groups: list[tuple[dict, NamedParams]], options: GroupOptions
    ) -> list[ShardGroupSpec]:
        """The dense parameters, partitioned over the data- and sequence-parallel ranks (given
        in ``options``: :attr:`zero`), and the experts', over the ranks holding the same experts
        (see [Note: several shard groups] in zero/optimizer.py): their gradients are averaged
        over every data-parallel rank, and the norm sums over the ranks holding other experts.
        ``options``: the config's, for this layout's groups to refine."""
        model, mesh = self.model, self.mesh
        sites = options.sites
        options = replace(
            options,
            sites=None if sites is None else self._site_options(sites),
            model_parallel=self._model_parallel(),
            summed={**self.tied, **self._sequence_summed()},
            chunks=model.chunks_of() if isinstance(model, PipelineModule) else {},
        )
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        of_experts = expert_tensors(model)

        def part(expert: bool) -> tuple[list[tuple[dict, NamedParams]], NamedParams]:
            mine = [
                (hyper, [(n, p) for n, p in named if (id(p) in of_experts) == expert])
                for hyper, named in groups
            ]
            return mine, [(n, p) for n, p in frozen if (id(p) in of_experts) == expert]

        dense, dense_frozen = part(expert=False)
        experts, experts_frozen = part(expert=True)
        if not any(named for _, named in experts):  # no trained expert: the dense group holds all
            if experts_frozen and mesh.sizes["ep"] > 1:
                raise ConfigError(
                    "MoE: every expert parameter is frozen, with experts spread over ranks "
                    f"(ep_size {mesh.sizes['ep']}); train some expert parameters, or use ep_size=1"
                )
            return [(options, dense, dense_frozen + experts_frozen)]
        axes = [axis for axis in ("pp", "ep") if mesh.sizes[axis] > 1]
        expert_options = replace(
            options,
            comm=mesh.expert_dp,
            # the dense group's outer steps time the steps for the work split
            sites=None if options.sites is None else replace(options.sites, times_steps=False),
            average_over=mesh.dp.world_size,
            model_parallel=ModelParallel(mesh.axis(*axes), lambda _: 1) if axes else None,
        )
        return [(options, dense, dense_frozen), (expert_options, experts, experts_frozen)]

    def _site_options(self, sites: SiteOptions) -> SiteOptions:
        """``sites`` over this layout: the ranks holding the same shard at each site, the
        trainable parameters' fragments (see [Note: streaming fragments] in
        zerotrain/zero/outer_step.py) and the sites' shares of the batch."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        fragment_of = fragments_of(trainable, sites.fragments)
        return replace(
            sites,
            comm=self.mesh.sites,
            tiers=self.site_tiers,
            fragment_of=fragment_of,
            split=self.work_split,
        )

    def _model_parallel(self) -> ModelParallel | None:
        """The group the gradient norm sums over beyond the data-parallel one: the pipeline
        stages and tensor-parallel peers. A parameter counts once: one whole on every
        tensor-parallel peer (or a tied layer's copy on several stages) counts 1/peers on
        each."""
        mesh, tied = self.mesh, self.tied
        axes = [axis for axis in ("pp", "tp") if mesh.sizes[axis] > 1]
        if not axes:
            return None
        tp = mesh.sizes["tp"]

        def replicas(param: nn.Parameter) -> int:
            copies = tied[id(param)].world_size if id(param) in tied else 1
            return copies * (1 if is_split(param) else tp)

        return ModelParallel(mesh.axis(*axes), replicas)

    def _sequence_summed(self) -> dict[int, Communicator]:
        """Sequence parallelism's parameters: their gradients are summed over the tp group."""
        if self.tensor_parallel is None:
            return {}
        return {id(p): self.tensor_parallel.comm for p in self.tensor_parallel.summed}

    # -- the model's state ---------------------------------------------------------------------
    def broadcast_untrained_state(self) -> None:
        """The frozen parameters and buffers of the first rank holding the dense parameters to
        the others (data- and sequence-parallel), an expert's over the ranks holding that
        expert (trainable ones and frozen ones that stage 3 partitions, which the engine owns,
        are broadcast as their buckets are built), so all replicas start identical even without
        a shared seed."""
        model, mesh = self.model, self.mesh
        of_experts = expert_tensors(model)
        frozen = [p for p in model.parameters() if not p.requires_grad and owner_of(p) is None]
        for tensor in frozen + list(model.buffers()):
            comm = mesh.expert_dp if id(tensor) in of_experts else mesh.zero
            comm.broadcast(tensor.data, src=comm.root)

    def full_state(self, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """See ``ModelLayout.full_state``: split tensors made whole, the other expert-parallel
        ranks' experts and the other stages' layers added (a PipelineModule's keys are
        DeepSpeed's: ``<layer index>.<name>``, ``tied_modules.<key>.<name>``)."""
        entries = self.model.state_dict(keep_vars=True)
        out = own
        if self.tensor_parallel is not None:
            out = self.tensor_parallel.full_state(out, self.model)
        if self.mesh.sizes["ep"] > 1:  # the other expert-parallel ranks' experts
            of_experts = expert_tensors(self.model)
            mine = {k: v.cpu() for k, v in out.items() if id(entries.get(k)) in of_experts}
            for theirs in self.mesh.axis("ep").all_gather_object(mine):
                out.update(theirs)
        # a tied key (embedding and head) is one tensor, as in the model and DeepSpeed's
        # gather: torch.save then writes it once and load_state_dict keeps the tie
        first_key: dict[int, str] = {}
        for key, value in entries.items():
            first = first_key.setdefault(id(value), key)
            if first != key and first in out and key in out:
                out[key] = out[first]
        stages = self.stages
        if stages is None:
            return out
        merged: dict[str, torch.Tensor] = {}
        for stage_state in stages.all_gather_object({k: v.cpu() for k, v in out.items()}):
            merged.update(stage_state)
        return merged


def _sites(cfg: ZeroTrainConfig, world_size: int) -> int:
    """The sites the ``sites`` section splits ``world_size`` ranks into (1: no section, or
    synchronous training); ConfigError where they cannot be equal."""
    return 1 if cfg.sites is None else cfg.sites.count(world_size, local_ranks())


def _place_stages(
    model: PipelineModule, sites: int, world: Communicator, optimizer: Any, params: Any
) -> None:
    """Give ``model`` the pipeline position the mesh gives this rank ([Note: mesh layout]:
    the site axis outside the pipeline's), where its construction took another from the world
    rank alone (several sites of several stages); a client's optimizer or parameter list made
    before then would hold parameters the model no longer has: every rank refuses it alike."""
    if sites == 1 or model.num_stages == 1:  # the world rank's position is the mesh's
        return
    if isinstance(optimizer, torch.optim.Optimizer) or isinstance(params, (list, tuple)):
        raise ConfigError(
            "sites with a PipelineModule: this rank's pipeline stage is the site's, built again "
            "in initialize, so an optimizer or a parameter list made from the model before it "
            "holds parameters the model no longer has; give the optimizer in the config (or a "
            "callable taking the parameters), and model.parameters() unlisted"
        )
    per_position = world.world_size // (sites * model.num_stages)
    model.place((world.rank // per_position) % model.num_stages)


# steps each site's speed is measured over, between decisions on the shares (the sites' times
# cross the slow link during the step after: one all-reduce every this many steps)
SPLIT_WINDOW = 10


def _work_split(cfg: ZeroTrainConfig, mesh: Mesh) -> WorkSplit | None:
    """The sites' shares of the batch ([Note: a site's share of the batch] in
    zerotrain/zero/work_split.py); None: equal, or one site."""
    sites, count = cfg.sites, mesh.sizes["site"]
    if sites is None or count == 1 or sites.work_split == "equal":
        return None
    speeds = None if sites.work_split == "measured" else tuple(sites.work_split)
    if speeds is not None and len(speeds) != count:
        raise ConfigError(
            f"sites.work_split: {len(speeds)} speeds for {count} sites; give one per site "
            '(or "measured")'
        )
    return WorkSplit(
        sites=count,
        site=mesh.coordinates(mesh.world.rank)["site"],
        data_ranks=mesh.dp.world_size,
        micro=cfg.batch_sizes().train_micro_batch_size_per_gpu,
        speeds=speeds,
        window=SPLIT_WINDOW,
        in_site=mesh.in_site,
        across=mesh.sites,
    )


def _site_tiers(cfg: ZeroTrainConfig, mesh: Mesh) -> SiteTiers | None:
    """The outer exchange's two tiers over ``sites.clusters`` (see [Note: clusters of sites] in
    zerotrain/comm/site_clusters.py): given, or with ``auto`` found from the links measured
    now where the codec is chosen from them too (``sites.compression`` auto, 3 sites or
    more). None: one exchange over every site (one cluster, or a site in each)."""
    sites, count = cfg.sites, mesh.sizes["site"]
    if sites is None or count == 1:
        return None
    if isinstance(sites.clusters, list):
        clusters, how = _given_clusters(sites.clusters, count), "sites.clusters"
    elif sites.clusters == "auto" and count >= 3 and sites.compression.method == "auto":
        firsts = mesh.axis_ranks("site")[0]  # the first rank of each site
        links = probe_site_links(mesh.world, firsts, mesh.sites.timeout)
        clusters, how = cluster_sites(links, count), f"measured: {describe_links(links)}"
    else:
        return None
    if len(clusters) in (1, count):
        return None
    inside, leaders = mesh.site_tiers(clusters)
    return SiteTiers(clusters, inside, leaders, how)


def _given_clusters(given: list[list[int]], count: int) -> tuple[tuple[int, ...], ...]:
    """``sites.clusters``' lists, each ascending, ordered by their first site; every site in
    exactly one."""
    named = sorted(site for cluster in given for site in cluster)
    if named != list(range(count)) or not all(given):
        raise ConfigError(
            f"sites.clusters: {given} must name each of the {count} sites (0 to {count - 1}) "
            "exactly once, in clusters of at least one site; or use auto"
        )
    return tuple(sorted(tuple(sorted(cluster)) for cluster in given))


def _axis_timeouts(cfg: ZeroTrainConfig) -> dict[str, timedelta]:
    """The axes whose collectives time out apart from the world's: the sites', at
    ``sites.exchange_timeout_s`` (see docs/sites.md, "A site lost")."""
    sites = cfg.sites
    if sites is None or sites.exchange_timeout_s is None:
        return {}
    return {"site": timedelta(seconds=sites.exchange_timeout_s)}


def _start_sites_alike(model: nn.Module, mesh: Mesh) -> None:
    """Every site's model as the first site's (parameters and buffers, over the site axis),
    before the shard groups take the parameters: the outer steps average the sites' changes
    from one starting point ([Note: outer steps over shards] in zerotrain/zero/outer_step.py).
    Models built alike (the same seed) are left as they are: only their digests cross the
    slow links, not the model (a 124M-parameter one in fp32 takes minutes at 10 Mbit/s). A
    model built under zero.Init compares and copies its chunks: a site's rank holds the chunk
    the ranks at its place in the other sites hold (:func:`_check_init_partition`)."""
    sites = mesh.sites
    tensors = [*model.parameters(), *model.buffers()]
    digests = sites.all_gather_object(_digest(tensors))
    if all(digest == digests[0] for digest in digests):
        return
    for tensor in tensors:
        sites.broadcast(tensor.data, src=sites.root)


def _check_init_partition(model: nn.Module, mesh: Mesh) -> None:
    """A model built under zero.Init holds chunks of its parameters partitioned over the ranks
    Init chose; the dense shard group gathers them over the ranks that shard the model (a
    site's data-parallel ranks): those must be the same ranks, in order."""
    chunks = {ranks for p in model.parameters() if (ranks := partitioned_over(p)) is not None}
    if not chunks:
        return
    wanted = tuple(mesh.zero.members())
    if chunks != {wanted}:
        over = ", ".join(str(list(ranks)) for ranks in sorted(chunks))
        fix = "build the model whole (zero.Init partitions over a site's ranks or every rank)"
        if mesh.sizes["site"] > 1 and mesh.zero.world_size == mesh.in_site.world_size:
            fix = (
                "pass zero.Init the config given to initialize (config_dict_or_path=..., with "
                "its sites section: each site's ranks then hold a whole model)"
            )
        raise ConfigError(
            f"zero.Init partitioned this model over ranks {over}, and this run shards it over "
            f"ranks {list(wanted)} (mesh {mesh.sizes}); {fix}"
        )


def _digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 of the tensors' shapes, dtypes and bytes, in order."""
    digest = hashlib.sha256()
    for tensor in tensors:
        host = tensor.detach().to("cpu").contiguous()
        digest.update(f"{tuple(host.shape)}{host.dtype};".encode())
        digest.update(host.reshape(-1).view(torch.uint8).numpy().data)  # its buffer: no copy
    return digest.hexdigest()
