"""Drop-in replacements for the PPO numerics of other trainers, on ppo_fast's kernels.

    ppo_fast.compat.verl      verl 0.9.1: verl.trainer.ppo.core_algos (the losses, GAE and the
                              critic-free advantage estimators), verl.utils.torch_functional
    ppo_fast.compat.openrlhf  OpenRLHF 0.11.2: openrlhf.models.utils, openrlhf.models.loss, the
                              experience maker's advantages and returns
    ppo_fast.compat.trl       TRL 0.29.1: the PPO trainer's rollout arithmetic, the GRPO and RLOO
                              trainers' advantages

Without editing the trainer: ``ppo_fast.compat.verl_plugin`` (a ``verl.plugins`` entry point:
``algorithm.adv_estimator=ppo_fast_grpo`` and the like, and the ``PPO_FAST_VERL_PATCH`` opt-in)
and ``ppo_fast.compat.openrlhf.install()`` with its launcher ``python -m ppo_fast.compat.openrlhf``
(a Ray worker hook).

Each module keeps its peer's signatures, argument order, return types and quirks, so that a
trainer swaps one import and gets the same numbers; each says which of its functions run on
ppo_fast kernels and which stay plain torch. They import torch (``pip install ppo_fast[torch]``);
``import ppo_fast`` and ``import ppo_fast.compat`` do not.
"""
