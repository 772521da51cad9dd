"""mergescope entrypoint: Hydra composes the config and hands it to mergescope."""

import hydra
from omegaconf import DictConfig

from mergescope.cli import precheck, run

precheck()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
