"""The `sites` section: training across sites joined by slow links, DiLoCo's way (see
docs/sites.md)."""

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from zerotrain.config.section import (
    Beta,
    PositiveFloat,
    PositiveInt,
    Section,
    reject_bool,
)

__all__ = ["OuterCompressionConfig", "OuterOptimizerConfig", "OuterSGDParams", "SitesConfig"]


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
    ranks_per_site: PositiveInt | None = None
    """Ranks of each site, consecutive (site 0 is ranks 0 to ranks_per_site - 1); null: a
    site is one of torchrun's nodes (its `--nproc-per-node` ranks)."""

    @property
    def synchronous(self) -> bool:
        """Whether this is ordinary synchronous training (every step's gradients over every
        rank): one inner step and no outer optimizer."""
        return self.inner_steps == 1 and self.outer_optimizer is None
