"""Entry-point glue: the one TASKS table, one-line errors for unknown config options, the dispatcher."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig
from omegaconf.errors import InterpolationResolutionError

from mergescope.arm import arm_tasks, option_groups, settings_groups
from mergescope.config import CONF_DIR, check_finite, conf_options
from mergescope.errors import MergescopeError, did_you_mean

ARM_GROUPS = settings_groups()  # each arm's settings, declared in its arm.py: conf/<group>/default.yaml
GROUPS = ("model", "pair", "metric", "merge", "eval", "data", "task", "study", "tracking", *option_groups(), *ARM_GROUPS)

# task name (conf/task/<name>.yaml) -> "module:function"; handlers take (cfg, overrides). Imported on use, so a bad
# command line fails before torch or MLflow are imported. The arms' tasks are declared in their arm.py files
# (mergescope.arm); these are the study's own.
TASKS: dict[str, str] = {
    "study": "mergescope.study:run_study",
    "train": "mergescope.zoo.job:run_train",
    "analyze": "mergescope.analysis:run_analyze",
    "precision_check": "mergescope.precision_check:run_precision_check",
    **arm_tasks(),
}


def handler(task: str) -> Callable:
    """The function that runs ``task``; a did-you-mean error for an unknown task (the arms' tasks read from the
    registry now: an arm of your own may have joined since this module was imported)."""
    tasks = {**TASKS, **arm_tasks()}
    if task not in tasks:
        raise MergescopeError(f"unknown task '{task}': {did_you_mean(task, tasks)}")
    module, name = tasks[task].split(":")
    return getattr(importlib.import_module(module), name)


def options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    return conf_options(group, conf_dir)


def check_argv(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject unknown group options (``metric=ckaa``) with a 'did you mean' line before Hydra composes."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        group = key.split("@", 1)[0]
        if group not in GROUPS or "." in group:
            continue
        value = value.strip()
        if value.startswith("choice(") and value.endswith(")"):
            value = value[len("choice("):-1]
        for v in (x.strip() for x in value.split(",")):
            if v in ("null", "") or v in options(group, conf_dir):
                continue
            raise MergescopeError(f"unknown {group} '{v}': {did_you_mean(v, options(group, conf_dir))}")


def expand_multirun_study(argv: list[str], conf_dir: Path = CONF_DIR) -> list[str]:
    """``-m study=X``: the study's ``pair: all`` / ``metric: all`` sweep axes written out on the command line (every pair
    of its ``models``, every metric plug-in: what the study runner expands), since Hydra's own sweeper would look for a
    conf/pair/all.yaml; an axis the command line gives itself is left to it. A study that sets its models' ``languages``
    or ``one_language`` is refused: those are per model, not a sweep axis, and only the study runner
    (``python launch.py study=X``, no -m) applies them."""
    import yaml

    if not any(a in ("-m", "--multirun") for a in argv):
        return argv
    study = next((a.split("=", 1)[1].strip() for a in argv if a.split("=", 1)[0].lstrip("+~") == "study" and "=" in a), None)
    path = conf_dir / "study" / f"{study}.yaml"
    if not study or not path.is_file():
        return argv
    doc = yaml.safe_load(path.read_text()) or {}
    langs = [k for k in ("languages", "one_language") if doc.get(k)]
    if langs:
        raise MergescopeError(f"study={study} sets {' and '.join(langs)} (each model on its own language), which only the "
                              f"study runner applies: run `python launch.py study={study}` without -m")
    params = ((doc.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a and not a.startswith("-")}
    extra = []
    for key, spec in params.items():
        if str(spec).strip() != "all" or key in given:
            continue
        from mergescope.sweep import every_metric, every_pair  # only when a study sweeps "all" (it reads the registry)

        if key == "metric":
            extra.append(f"metric={every_metric()}")
        elif key == "pair":
            extra.append(f"pair={every_pair([str(m) for m in doc.get('models') or []])}")
    return [*argv, *extra]


FIXED_SECTIONS = ("paths", "represent", "control", "train", "report", *ARM_GROUPS)
"""Top-level sections of ``conf/config.yaml`` whose settings are fixed: ``+section.new_key=`` is a typo, not a setting."""
OPTIONAL_KEYS = ("native.transplant", "native.outcome", "native.nll_langs")
"""Settings of a fixed section that its defaults leave out (absent = off, so that no earlier job's hash changes): added
with ``+`` (``+native.transplant=union``, ``+native.transplant.k=32``, ``+native.outcome=both``, ``+native.nll_langs=[..]``);
the arm's settings check their values."""


def check_added_keys(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Refuse ``+represent.layr=2``: a key added with ``+`` inside a section with fixed settings would be ignored."""
    import yaml

    base = None
    for arg in argv:
        if not arg.startswith("+") or arg.startswith("++") or "=" not in arg:
            continue
        parts = arg[1:].split("=", 1)[0].split(".")
        if len(parts) < 2 or parts[0] not in FIXED_SECTIONS or ".".join(parts[:2]) in OPTIONAL_KEYS:
            continue
        if base is None:  # conf/config.yaml, and each arm's default settings under its own key
            base = yaml.safe_load((conf_dir / "config.yaml").read_text()) or {}
            for g in ARM_GROUPS:
                if (conf_dir / g / "default.yaml").is_file():
                    base[g] = yaml.safe_load((conf_dir / g / "default.yaml").read_text()) or {}
        node = base
        for i, part in enumerate(parts):
            if not isinstance(node, dict):
                break
            if part not in node:
                where = ".".join(parts[:i]) or "the config"
                choices = [f"{'.'.join(parts[:i])}.{k}" for k in node]
                raise MergescopeError(f"unknown setting '{'.'.join(parts)}': {where} has no '{part}' "
                                      f"({did_you_mean('.'.join(parts[:i + 1]), choices)}); '+' adds a key that nothing "
                                      "reads: drop the '+' to set an existing one")
            node = node[part]


def scrub(text: str, argv: list[str] | None = None) -> str:
    """``text`` with every secret of the command line replaced (the value of a secret key, ``+hf_token=...``, also
    inside a dict value, and every secret-shaped value: ``config.override_secrets``), and every URI password and
    secret-shaped value: what an error message or a traceback may print."""
    from mergescope.config import override_secrets, redact_text

    for arg in sys.argv[1:] if argv is None else argv:
        for value in override_secrets(arg):
            text = text.replace(value, "<redacted>")
    return redact_text(text)


def verbose_flag(argv: list[str]) -> list[str]:
    """``-v`` / ``--verbose`` (not Hydra flags) as the ``verbose=true`` override."""
    if not any(a in ("-v", "--verbose") for a in argv):
        return argv
    return [*(a for a in argv if a not in ("-v", "--verbose")), "verbose=true"]


def precheck(argv: list[str] | None = None) -> None:
    if argv is None:
        sys.argv[1:] = verbose_flag(sys.argv[1:])
        guard_hydra()
    args = sys.argv[1:] if argv is None else argv
    try:
        check_argv(args)
        check_added_keys(args)
        args = expand_multirun_study(args)
        if argv is None:
            sys.argv[1:] = args
    except MergescopeError as exc:
        print(f"error: {scrub(str(exc), args)}", file=sys.stderr)
        sys.exit(exc.exit_code)


def key_choices(path: str, argv: list[str], conf_dir: Path = CONF_DIR) -> list[str]:
    """The keys that exist under ``path`` (dotted; "" = the top level) of the config a command line composes: the
    top-level sections and groups, a section's keys in conf/config.yaml, or a group option's keys (the option the
    command line picks, else the default)."""
    from omegaconf import OmegaConf

    top = OmegaConf.to_container(OmegaConf.load(conf_dir / "config.yaml"), resolve=False)
    parts = [p for p in path.split(".") if p]
    if not parts:
        return sorted({k for k in top if k != "defaults"} | set(GROUPS))
    node: object = top
    if parts[0] in GROUPS and parts[0] not in top:
        picked = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+~") == parts[0] and "=" in a]
        default = [next(iter(d.values())) for d in top.get("defaults", []) if isinstance(d, dict) and next(iter(d)) == parts[0]]
        option = (picked or default or [None])[0]
        if option is None or not (conf_dir / parts[0] / f"{option}.yaml").is_file():
            return []
        node, parts = OmegaConf.to_container(OmegaConf.load(conf_dir / parts[0] / f"{option}.yaml"), resolve=False), parts[1:]
    for p in parts:
        if not isinstance(node, dict) or p not in node:
            return []
        node = node[p]
    return sorted(k for k in node if k != "defaults") if isinstance(node, dict) else []


def key_hint(line: str, argv: list[str], conf_dir: Path = CONF_DIR) -> str:
    """A did-you-mean for Hydra's 'Could not override 'a.b'. Key 'b' is not in struct' (an unknown key)."""
    m = re.search(r"Could not override '([^']+)'\. Key '([^']+)' is not in struct", line)
    if not m:
        return ""
    parts, missing = m.group(1).split("."), m.group(2)
    parent = ".".join(parts[:parts.index(missing)]) if missing in parts else m.group(1).rpartition(".")[0]  # 'nativ.x': top
    choices = key_choices(parent, argv, conf_dir)
    return did_you_mean(m.group(2), choices) if choices else ""


def _hydra_one_line(ex: BaseException) -> str:
    """Hydra's or OmegaConf's own error (a bad override, a missing key) as one line, secrets scrubbed."""
    lines = [ln.strip() for e in (ex, ex.__cause__) if e is not None for ln in str(e).splitlines() if ln.strip()]
    text = " ".join(dict.fromkeys(ln for ln in lines if not ln.startswith(("full_key:", "object_type=", "Set the environment"))))
    text = re.sub(r"\s*To append to your config use \S+", "", text)
    return scrub(text or type(ex).__name__)


def _run_and_report(func: Callable):
    """Replaces Hydra's run_and_report: Hydra's own errors are one line and exit 2; anything else a scrubbed traceback."""
    import os
    import traceback

    try:
        return func()
    except Exception as ex:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(ex, (HydraException, OmegaConfBaseException)):
            line = _hydra_one_line(ex)
            hint = key_hint(line, sys.argv[1:])
            print(f"error: {line}{': ' + hint if hint else ''} (Hydra: key=value sets, +key=value adds, see "
                  "docs/configuration.md)", file=sys.stderr)
            sys.exit(MergescopeError.exit_code)
        print(scrub(traceback.format_exc()), file=sys.stderr, end="")
        sys.exit(1)


def _private_yaml(cfg, path: Path) -> None:
    """A Hydra config file, secrets redacted, readable by its owner only."""
    import os

    from omegaconf import OmegaConf

    from mergescope.config import redact

    plain = OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg
    text = OmegaConf.to_yaml(OmegaConf.create(redact(plain)))
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, 0o600)


def guard_hydra() -> None:
    """Before Hydra runs: its output files (``.hydra/*.yaml``, ``multirun.yaml``) are written with secrets redacted and
    mode 600, and its own errors are one line (exit 2) that never echo a raw override."""
    import hydra._internal.utils as hydra_utils
    import hydra.core.utils as hydra_core
    from omegaconf import OmegaConf

    def save_config(cfg, filename: str, output_dir: Path) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        _private_yaml(cfg, Path(output_dir) / filename)

    plain_save = OmegaConf.save

    def save(config, f, resolve: bool = False) -> None:  # the sweeper's multirun.yaml (its module is re-imported by
        if isinstance(f, (str, Path)) and Path(f).name == "multirun.yaml":  # Hydra's plugin scan: patched here)
            _private_yaml(OmegaConf.create(OmegaConf.to_container(config, resolve=resolve)), Path(f))
        else:
            plain_save(config, f, resolve)

    if not getattr(OmegaConf.save, "_mergescope", False):
        save._mergescope = True  # type: ignore[attr-defined]
        OmegaConf.save = staticmethod(save)  # type: ignore[method-assign]
    hydra_core._save_config = save_config
    hydra_utils.run_and_report = _run_and_report
    scrub_log_records()


def scrub_log_records() -> None:
    """Every log record (Hydra's launcher lists each job's overrides) has secret override values replaced."""
    import logging

    make = logging.getLogRecordFactory()
    if getattr(make, "_mergescope", False):
        return

    def record(*args, **kwargs):
        rec = make(*args, **kwargs)
        try:
            text = rec.getMessage()
        except Exception:  # a malformed record: left to logging's own error report
            return rec
        clean = scrub(text)
        if clean != text:
            rec.msg, rec.args = clean, ()
        return rec

    record._mergescope = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(record)


def task_overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return list(HydraConfig.get().overrides.task)
    except Exception:
        pass
    return []


COUNT_SETTINGS = ("data.max_sentences", "native.nll_sentences", "adaptation.nll_sentences")
"""Sentence counts: a positive integer, or null for all of them (checked before any job)."""


def check_counts(cfg: DictConfig) -> None:
    from omegaconf import OmegaConf

    from mergescope.data import positive_count

    for key in COUNT_SETTINGS:
        positive_count(OmegaConf.select(cfg, key), key)
    scope = OmegaConf.select(cfg, "analysis.nll_scope", default="rest")
    if scope not in ("rest", "all"):
        raise MergescopeError(f"analysis.nll_scope={scope}: give rest (each sentence's first token apart, the default) or all "
                              "(every token)")


def check_outputs(cfg: DictConfig) -> None:
    """What a job writes and needs besides its inputs, checked before any run: ``save=true`` writes under
    ``paths.merged`` (a folder, or one it can create), and ``eval=lm_eval`` needs lm-evaluation-harness installed."""
    if cfg.get("save"):
        merged = Path(str(cfg.paths.get("merged") or Path(str(cfg.paths.root)) / "merged")).expanduser()
        blocker = next((p for p in (merged, *merged.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise MergescopeError(f"paths.merged={merged}: {blocker} is a file, not a folder; save=true writes each "
                                  "model into a folder there: point paths.merged at a folder (or set save=false)")
    if cfg.get("eval") is not None and str(cfg.eval.get("name")) == "lm_eval":
        import importlib.util

        try:
            found = importlib.util.find_spec("lm_eval") is not None
        except (ImportError, ValueError):  # a module entry of None: not importable
            found = False
        if not found:
            from mergescope.scoring.lmeval import INSTALL

            raise MergescopeError(INSTALL)


def dispatch(cfg: DictConfig, overrides: list[str] | None = None):
    """Run the configured task; raises MergescopeError on bad input."""
    fn = handler(str(cfg.task.name))
    check_finite(cfg)  # a NaN or infinite setting anywhere (merge.weights=[nan,1]): refused before any model loads
    check_counts(cfg)
    check_outputs(cfg)
    overrides = task_overrides() if overrides is None else overrides
    from mergescope import models

    models.DIGEST_CACHE[:] = [Path(str(cfg.paths.cache)) / "digests"]  # model files' digests, read once per version
    if cfg.get("num_threads"):
        from mergescope.device import set_threads

        set_threads(int(cfg.num_threads))
    return fn(cfg, overrides)


def run(cfg: DictConfig):
    """The Hydra app body: one-line error and exit 2 on bad input."""
    from mergescope.runs import JobResult

    import traceback

    try:
        result = dispatch(cfg)
    except MergescopeError as exc:
        print(f"error: {scrub(str(exc))}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except InterpolationResolutionError as exc:  # a resolver's own error (tracking=server with no server): one line
        head = "MergescopeError raised while resolving interpolation: "
        if head not in str(exc):
            print(scrub(traceback.format_exc()), file=sys.stderr, end="")
            sys.exit(1)
        print(f"error: {scrub(str(exc).split(head, 1)[1].splitlines()[0])}", file=sys.stderr)
        sys.exit(MergescopeError.exit_code)
    except Exception as exc:  # never handed to Hydra, which would echo the raw overrides
        if type(exc).__module__.startswith("sqlalchemy"):
            print(f"error: the tracking store failed ({type(exc).__name__}: {scrub(str(exc).splitlines()[0])[:300]}); "
                  "check tracking.uri, or move a broken mlflow.db aside", file=sys.stderr)
            sys.exit(MergescopeError.exit_code)
        print(scrub(traceback.format_exc()), file=sys.stderr, end="")
        sys.exit(1)
    if isinstance(result, JobResult):
        print(report(result))


def report(result) -> str:
    head = (f"skipped: FINISHED run {result.run_id} has the same cfg_hash {result.cfg_hash} (rerun=true to run again)"
            if result.skipped else f"run {result.run_id} FINISHED (cfg_hash {result.cfg_hash})")
    body = ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.metrics.items()))
    return f"{head}\n  {body}"
