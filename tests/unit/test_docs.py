"""The docs' reference pages are generated from the code (scripts/docs_reference.py) and must match it: a key,
a command or a hook added, changed or removed without regenerating them fails here. The site's own build
(`mkdocs build --strict`: broken links, pages missing from the nav) runs in CI (.ci/run)."""

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page", ["config.md", "cli.md", "hooks.md", "types.md"])
def test_the_reference_page_is_what_the_code_generates(generator, page):
    assert (ROOT / "docs" / "reference" / page).read_text() == generator.PAGES[page](), (
        f"docs/reference/{page} is stale: run .venv/bin/python scripts/docs_reference.py")


def test_every_key_of_a_full_config_is_in_the_config_reference(generator):
    from rlx.config import load_config

    page = generator.config_page()
    cfg = load_config(ROOT / "examples" / "quickstart.yaml").to_data()

    def component(v):  # a component chosen by name (a loss, rewards, loggers): its args are its own
        return isinstance(v, dict) and {"name", "args"} <= set(v) <= {"name", "args", "weight"}

    def keys(node, path):
        for k, v in node.items():
            key = f"{path}.{k}" if path else k
            if isinstance(v, dict) and v and not component(v) and not key.endswith(("args", "kernels")):
                yield from keys(v, key)
            elif isinstance(v, list) and v and isinstance(v[0], dict) and not component(v[0]):
                yield from keys(v[0], f"{key}[]")
            else:
                yield key

    missing = [k for k in keys(cfg, "") if f"| `{k}` |" not in page]
    assert missing == [], missing
    documented = re.findall(r"^\| `([a-z_.\[\]{}]+)` \| .*\| (.*) \|$", page, re.M)
    assert len(documented) > 150 and sum(1 for _, what in documented if what.strip()) / len(documented) > 0.8


def test_every_command_and_hook_is_in_its_reference_page(generator):
    from rlx import hookspecs

    cli, hooks = generator.cli_page(), generator.hooks_page()
    for command in ("train", "rollout", "serve", "eval", "plot", "plugins", "config validate", "config show"):
        assert f"## `rl {command}" in cli, command
    specs = [n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "rlx_spec")]
    assert len(specs) >= 14 and all(f"### `{n}(" in hooks for n in specs)


def test_every_docs_page_is_in_the_sites_navigation():
    def pages(nav):
        for item in nav:
            for v in (item.values() if isinstance(item, dict) else [item]):
                yield from (pages(v) if isinstance(v, list) else [v])

    listed = set(pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    present = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert present - listed == set() and listed - present == set()
