"""The `sites` section: training across sites joined by slow links, DiLoCo's way (see
docs/sites.md)."""

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from zerotrain.config.errors import ConfigError, fail
from zerotrain.config.section import (
    Beta,
    Fraction,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    reject_bool,
)

__all__ = [
    "OuterCompressionConfig",
    "OuterOptimizerConfig",
    "OuterSGDParams",
    "SitesConfig",
    "StreamingConfig",
]


class OuterSGDParams(Section):
    """`sites.outer_optimizer.params`: SGD's, over the sites' averaged parameter change."""

    lr: PositiveFloat = 0.7
    """The outer learning rate (DiLoCo's 0.7): 1 without momentum takes the average."""
    momentum: Beta = 0.9
    """Momentum of the outer steps (DiLoCo's 0.9)."""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo's)."""


class OuterOptimizerConfig(Section):
    """`sites.outer_optimizer`: what each outer step applies to the sites' averaged change of
    the parameters since the last one (their pseudo-gradient)."""

    type: Literal["SGD"] = "SGD"
    """SGD, with momentum and Nesterov's as DiLoCo (arXiv:2311.08105) steps."""
    params: OuterSGDParams = Field(default_factory=OuterSGDParams)
    """Its hyperparameters."""


class OuterCompressionConfig(Section):
    """`sites.compression`: how the outer exchange travels between the sites (the links
    inside a site are configured by `comm_compression`). The codecs are
    `comm_compression.gradients`' element-wise ones (docs/compression.md), over each rank's
    shard of the sites' parameter change."""

    method: Literal["none", "int8", "int4", "topk", "auto"] = "none"
    """`int8`, `int4`: block-wise quantized (4x, 8x fewer bytes); `topk`: each rank's `ratio`
    largest elements of its change, with error feedback (what is left out is added to the
    next outer step's change); `auto`: none or int8, whichever costs less on the sites' link,
    measured at the first outer step (its alpha and beta, and each codec's own compute), as
    `comm_compression.auto` chooses; the step line says which."""
    ratio: Annotated[float, BeforeValidator(reject_bool), Field(gt=0, le=1)] = 0.01
    """topk: the fraction of the change sent."""
    block_size: PositiveInt = 256
    """int8 / int4: elements per quantization block, each with its own fp32 scale."""


class StreamingConfig(Section):
    """`sites.streaming`: the outer exchange a fragment of the model at a time (Streaming
    DiLoCo, arXiv:2501.18512), so the slow link carries a small message every few steps
    instead of the whole model every `inner_steps`, and the inner steps go on while it
    travels."""

    fragments: PositiveInt = 4
    """The parameters, in the model's order, split into this many runs of about equal size;
    each has its own outer step every `inner_steps` steps, the fragments' spread evenly over
    the round (fragment f at step (f + 1) * inner_steps / fragments of it)."""
    overlap_steps: NonNegativeInt = 1
    """Inner steps a fragment's exchange travels while training goes on (0: each rank waits
    for it at its step); it lands this many steps after it left."""
    mixing: Fraction = 0.5
    """With `overlap_steps`: the weight of a site's own parameters when its fragment's outer
    step lands (they moved on while the exchange travelled); the rest is the outer step's
    result. 0 takes the outer step's result alone."""


class SitesConfig(Section):
    """Training across sites (a zerotrain section; docs/sites.md): each site trains as the rest
    of the config says over its own ranks (ZeRO inside it), for `inner_steps` optimizer steps
    on its share of the batch; then every rank exchanges the change of its part of the
    parameters with the ranks holding the same part at the other sites, and an outer step
    (DiLoCo, arXiv:2311.08105) moves every site to the same parameters. The slow links carry
    one exchange every `inner_steps` steps instead of one per step. `inner_steps` 1 without
    an outer optimizer is ordinary synchronous training over every rank."""

    inner_steps: PositiveInt = 100
    """Optimizer steps each site takes alone between outer steps (DiLoCo's H)."""
    outer_optimizer: OuterOptimizerConfig | None = Field(default_factory=OuterOptimizerConfig)
    """The outer step; null: the sites' parameters are averaged."""
    compression: OuterCompressionConfig = Field(default_factory=OuterCompressionConfig)
    """How the outer exchange travels; see the sites.compression section."""
    streaming: StreamingConfig | None = None
    """The outer exchange a fragment at a time, overlapped with the inner steps; see the
    sites.streaming section. null: the whole model at each round's end, the ranks waiting
    for it."""
    work_split: Literal["equal", "measured"] | list[PositiveFloat] = "equal"
    """Each site's share of a step's batch (the global batch stays as configured): `equal`,
    the configured micro-batch on every rank; `measured`, shares that follow each site's
    measured speed (samples a second, measured again every 10 steps), so that a faster
    site's steps take more samples and no site waits for another at the outer steps; a list,
    fixed relative speeds, one per site. A site's micro-batch stays between 1 and twice the
    configured one. The outer step weighs each site's change by the samples it
    trained. Batches are sized for it by the engine's dataloader (`training_data`); a loop
    that makes its own takes `engine.train_micro_batch_size_per_gpu()` samples each step."""
    exchange_timeout_s: PositiveFloat | None = None
    """Seconds a collective between the sites may take (each outer exchange, and the start's
    copy of the first site's model, tensor by tensor) before it fails with the lost-site error;
    null: the collective timeout (ZEROTRAIN_TIMEOUT, 10 minutes by default). Set it above
    the largest of them on the link (a rank's shard of the parameters, in the exchange's
    codec, over the link's rate) so that a site lost or cut off is noticed in that time while
    the links inside a site keep the collective timeout."""
    clusters: Literal["auto", "none"] | list[list[NonNegativeInt]] = "auto"
    """Sites joined by fast links, which exchange whole among themselves: with two clusters
    or more, each outer exchange is summed whole inside each cluster, travels in
    `compression`'s codec between one rank of each cluster, and is sent back whole inside
    it, so the slow links carry one compressed message per cluster and the fast ones no
    compression error. `auto`: where `compression` is `auto` too and there are 3 sites or
    more, the link between every pair of sites is measured at the start, and sites joined by
    links of at least 4x the slowest one's bandwidth share a cluster (the step line says
    which); otherwise one exchange over every site. `none`: one exchange over every site; a
    list, the sites' numbers grouped, each site in one (`[[0, 1], [2]]`). One cluster, or a
    site in each, is one exchange over every site in `compression`'s codec."""
    ranks_per_site: PositiveInt | None = None
    """Ranks of each site, consecutive (site 0 is ranks 0 to ranks_per_site - 1); null: a
    site is one of torchrun's nodes (its `--nproc-per-node` ranks)."""

    @model_validator(mode="after")
    def _fragments_fit_the_round(self) -> "SitesConfig":
        streaming = self.streaming
        if streaming is None:
            return self
        if streaming.fragments > self.inner_steps:
            raise fail(
                f"sites.streaming.fragments: {streaming.fragments} fragments do not fit a "
                f"round of {self.inner_steps} inner steps (each takes its outer step at its "
                "own step of the round); use at most sites.inner_steps fragments"
            )
        if streaming.overlap_steps >= self.inner_steps:
            raise fail(
                f"sites.streaming.overlap_steps: {streaming.overlap_steps} must be less than "
                f"sites.inner_steps ({self.inner_steps}): a fragment's exchange lands before "
                "its next one leaves"
            )
        return self

    def count(self, world_size: int, ranks_per_node: int) -> int:
        """The sites ``world_size`` ranks split into (1: synchronous training), a site being
        ``ranks_per_site`` ranks, or else a node's (``ranks_per_node``: torchrun's); a
        ConfigError where they cannot be equal."""
        if self.synchronous:
            return 1
        per_site = self.ranks_per_site or ranks_per_node
        if world_size % per_site:
            named = "ranks_per_site" if self.ranks_per_site else "torchrun's --nproc-per-node"
            raise ConfigError(
                f"sites.ranks_per_site: {world_size} ranks do not split into sites of "
                f"{per_site} ({named}); make the ranks a multiple of the site's"
            )
        return world_size // per_site

    @property
    def synchronous(self) -> bool:
        """Whether this is ordinary synchronous training (every step's gradients over every
        rank): one inner step and no outer optimizer."""
        return self.inner_steps == 1 and self.outer_optimizer is None
