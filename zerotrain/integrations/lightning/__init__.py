"""Lightning on zerotrain, natively (no DeepSpeed involved): :mod:`.fabric` for Lightning Fabric,
:mod:`.trainer` for the Lightning Trainer, each with a ``ZeroTrainStrategy``. Importing this
package registers the strategy names (``zerotrain``, ``zerotrain_stage_1``/``_2``/``_3``,
``zerotrain_stage_2_offload``, ``zerotrain_stage_3_offload``) with both."""

from zerotrain.integrations.lightning import fabric, trainer

__all__ = ["fabric", "trainer"]
