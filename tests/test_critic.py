"""The critic and GAE (``algorithm.advantage: gae``, ``critic``): its settings refused in one
line naming the key, a learner training a critic beside the policy, GAE's advantages from
its values, its checkpoint, and a short run end to end."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config


@pytest.mark.parametrize("overrides, says", [
    (["algorithm.advantage=gae", "critic=true", "algorithm.lam=1.5"], "'algorithm.lam'"),
    (["algorithm.advantage=gae", "critic=true", "algorithm.gamma=-0.1"], "'algorithm.gamma'"),
    (["algorithm.advantage=gae"], "algorithm.advantage=gae needs a critic"),
    (["critic.value_clip=0.2"], "critic is set, but algorithm.advantage=grpo"),
    (["algorithm.whiten_advantages=false"], "algorithm.whiten_advantages=false is for algorithm.advantage=gae"),
    (["algorithm.advantage=gae", "critic=true", "critic.value_clip=0"], "'critic.value_clip'"),
    (["algorithm.advantage=gae", "critic.lora.sync=merged"], "critic.lora.sync=merged"),
    (["algorithm.advantage=gae", "critic=true", "learner.url=http://127.0.0.1:1", "model.lora=true",
      "algorithm.bypass=true"], "algorithm.advantage=gae (needs a group-relative estimator"),
])
def test_bad_critic_settings_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_critic_is_off_by_default_and_on_with_any_of_its_keys():
    assert load_config(None, []).critic is None
    cfg = load_config(None, ["algorithm.advantage=gae", "critic.optim.lr=3e-4", "critic.lora.rank=4"])
    assert cfg.critic.optim.lr == 3e-4 and cfg.critic.lora.rank == 4 and cfg.critic.value_clip == 0.2
    assert cfg.critic.model.path is None and cfg.critic.warmup_steps == 0
    assert (cfg.algorithm.gamma, cfg.algorithm.lam, cfg.algorithm.whiten_advantages) == (1.0, 0.95, None)
