"""The ``verl.plugins`` entry point (pyproject.toml): ``import verl`` imports this module in the
driver and in every worker, which registers ppo_fast's names (``verl_plugin.load_plugin``)."""

from .verl_plugin import load_plugin

load_plugin()
