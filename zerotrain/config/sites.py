"""The `sites` section: training across sites joined by slow links, DiLoCo's way (see
docs/sites.md)."""

from typing import Literal

from pydantic import Field

from zerotrain.config.section import Beta, PositiveFloat, PositiveInt, Section

__all__ = ["OuterOptimizerConfig", "OuterSGDParams", "SitesConfig"]


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
    ranks_per_site: PositiveInt | None = None
    """Ranks of each site, consecutive (site 0 is ranks 0 to ranks_per_site - 1); null: a
    site is one of torchrun's nodes (its `--nproc-per-node` ranks)."""

    @property
    def synchronous(self) -> bool:
        """Whether this is ordinary synchronous training (every step's gradients over every
        rank): one inner step and no outer optimizer."""
        return self.inner_steps == 1 and self.outer_optimizer is None
