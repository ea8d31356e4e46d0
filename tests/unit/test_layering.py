"""The package's layers, declared once: a module imports only from its own layer or below (lazy imports inside
functions included; ``if TYPE_CHECKING:`` blocks excluded, see ``test_import_graph``). A new top-level module or
package must be placed here before it can be imported."""

from __future__ import annotations

from tests.unit.test_import_graph import import_graph

# lowest first; each entry a top-level module or package of megatron_dapo
LAYERS = [
    ["types", "versions"],  # the data that flows; nothing of ours
    ["config"],  # typed config: YAML, dotted overrides, validation
    ["models", "runs", "metrics", "report", "ports"],  # architectures and families, memory model; run folders, metrics
    ["algo", "data", "reward", "rollouts"],  # pure functions, datasets, verifiers, rollout functions and tools
    ["actor", "bridge", "engines", "sync"],  # the trainer, the weights' way to the engines, the engines
    ["loop"],  # trainer, schedules, phases, the control plane
    ["planning", "launch"],  # planning a job, launching it
    ["cli"],
]


# Modules whose layer is not their package's: an engine's config block and the registry of engines are config (the
# config builds RolloutConfig from them, so that no config module names an engine); they import config's typing only
# (and the packages' empty __init__ files, which any import of them runs)
CONFIG_LEVEL = (
    "engines",
    "engines.sglang",
    "engines.registry",
    "engines.hf_options",
    "engines.sglang.options",
    "engines.vllm",
    "engines.vllm.options",
)


def layer_of(module: str) -> int | None:
    """The layer of ``megatron_dapo.<head>...``; None for the package itself; KeyError for an undeclared head."""
    name = module.removeprefix("megatron_dapo").lstrip(".")
    if not name:
        return None
    if name in CONFIG_LEVEL:
        return 1
    head = name.split(".")[0]
    for i, group in enumerate(LAYERS):
        if head in group:
            return i
    raise KeyError(head)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        here = layer_of(module)
        for dep in sorted(deps):
            there = layer_of(dep)
            if here is not None and there is not None and there > here:
                out.append(f"{module} (layer {here}) imports {dep} (layer {there})")
    return out


def test_every_module_is_in_a_layer():
    undeclared = set()
    for module in import_graph():
        try:
            layer_of(module)
        except KeyError as e:
            undeclared.add(e.args[0])
    assert not undeclared, f"declare these in LAYERS: {sorted(undeclared)}"


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports(import_graph()) == []


def test_a_planted_upward_import_is_caught():
    graph = import_graph()
    graph["megatron_dapo.algo.loss"] = graph["megatron_dapo.algo.loss"] | {"megatron_dapo.loop.trainer"}
    assert upward_imports(graph) == ["megatron_dapo.algo.loss (layer 3) imports megatron_dapo.loop.trainer (layer 5)"]


def test_the_config_level_engine_modules_stay_config_level():
    """What CONFIG_LEVEL lifts holds no more than config: the packages' __init__ files are empty."""
    from tests.helpers import REPO

    for module in CONFIG_LEVEL:
        path = REPO / "megatron_dapo" / module.replace(".", "/")
        if path.is_dir():
            assert (path / "__init__.py").read_text().strip() == "", f"{module}/__init__.py must stay empty"
