"""Write a randomly initialised actor checkpoint: ``python -c "...main([DIR, key=value...])"`` (used by the eval test)."""

from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.config.run_config import load_config


def main(argv: list[str]) -> None:
    cfg = load_config("demo_cpu", argv[1:])
    MegatronActor(cfg).save(argv[0])
