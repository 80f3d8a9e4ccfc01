"""The README and docs/ hold together: the protocol table in docs/architecture.md is the one
cluster_node.protocol.table renders, every relative link (and its #anchor) resolves, every section of the old
one-page README survives under some heading, and the README's two commands stay what CI and the Makefile run."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]


def _docs_protocol():
    spec = importlib.util.spec_from_file_location("docs_protocol", REPO / "scripts" / "docs_protocol.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_docs_protocol_table_is_the_one_the_package_renders():
    from cluster_node.protocol.table import protocol_table

    docs_protocol = _docs_protocol()
    text = (REPO / "docs" / "architecture.md").read_text()
    _, table, _ = docs_protocol.split(text)
    assert table == protocol_table(), "run `python scripts/docs_protocol.py` to regenerate docs/architecture.md's table"
    assert docs_protocol.main(["--check"]) == 0


def test_the_check_mode_names_a_stale_table(tmp_path):
    docs_protocol = _docs_protocol()
    stale = tmp_path / "architecture.md"
    stale.write_text(f"# x\n\n{docs_protocol.BEGIN} -->\n| old |\n{docs_protocol.END}\n")
    assert docs_protocol.main(["--check", "--doc", str(stale)]) == 1
    assert docs_protocol.main(["--doc", str(stale)]) == 0
    assert docs_protocol.main(["--check", "--doc", str(stale)]) == 0


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code (links there are examples, not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but - and _ removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_the_slug_rule_matches_githubs_for_our_headings():
    assert _slug("`fab check --json`") == "fab-check---json"
    assert _slug("The image's torch") == "the-images-torch"
    assert (
        _slug("Configuration (`-c key=value`, or `cdk.json` context)") == "configuration--c-keyvalue-or-cdkjson-context"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: outside the repository
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.name}: {broken}"


# The headings of the one-page README before it moved to docs/ (issue 20 item 7): each must survive.
OLD_SECTIONS = (
    "Quick start",
    "Layout",
    "Cost safety",
    "Picking `access` and `efa`",
    "Spot nodes",
    "Configuration (`-c key=value`, or `cdk.json` context)",
    "Deploy readiness: what was verified offline, what only a real deploy can verify",
    "First real cluster: a checklist",
    "Text input pipeline",
    "Real data",
    "The image's torch",
    "Is the network the bottleneck?",
    "When nodes fail",
    "`fab check --json`",
    "Tests",
    "Measured (2-core machine; relative figures, one run each)",
    "Not yet",
)


def test_every_section_of_the_old_readme_survives_under_a_heading():
    headings = set()
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        headings |= set(re.findall(r"^#{1,6} (.+)$", text, flags=re.M))
    assert [s for s in OLD_SECTIONS if s not in headings] == []
    tasks = (REPO / "docs" / "tasks.md").read_text()
    assert tasks.startswith("# The tasks (`fab --list`)")
    assert "## The commands" in (REPO / "docs" / "operations.md").read_text()  # the old "On AWS" block


def test_the_readmes_two_commands_are_the_makefiles_and_ci_runs_the_test_command():
    readme = (REPO / "README.md").read_text()
    block = (
        "```\n"
        "make demo    # set-up, then the main job on an emulated 2-node cluster\n"
        "make test    # set-up, then every test\n"
        "```\n"
    )
    assert block in readme
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo: setup$", makefile, flags=re.M) and re.search(r"^test: setup$", makefile, flags=re.M)
    assert re.search(r"^make test$", (REPO / ".ci" / "run").read_text(), flags=re.M)


def test_the_readme_stays_a_ten_minute_read():
    words = len(_prose((REPO / "README.md").read_text()).split())
    assert words <= 2000, f"README.md has {words} words of prose; move detail to docs/"


def test_every_supervisor_transition_in_the_architecture_doc_has_its_unit_test():
    """docs/architecture.md's transition table matches the code: each row N is exercised by a
    tests/test_supervisor.py test named test_rowN (or test_rowA_N_... covering several)."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("| # | from | event / guard |") :].split("\n\n", 1)[0]
    rows = {int(m.group(1)) for m in re.finditer(r"^\| (\d+) \|", table, re.M)}
    assert rows == set(range(1, 18)), rows
    tests = (REPO / "tests" / "test_supervisor.py").read_text()
    covered = {int(n) for name in re.findall(r"def test_row([\d_]+?)_[a-z]", tests) for n in name.split("_") if n}
    assert rows <= covered, f"rows without a test: {sorted(rows - covered)}"


MODULE_PACKAGES = {
    "cluster_node": REPO / "assets" / "cluster_node",
    "train": REPO / "assets" / "train",
    "clusterops": REPO / "clusterops",
    "fabfile": REPO / "fabfile",
}


def _package_modules() -> set[str]:
    """`package/module.py` for every module of the four packages; an __init__.py only when it holds more
    than its docstring."""
    found = set()
    for package, root in MODULE_PACKAGES.items():
        for path in root.rglob("*.py"):
            body = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
            docstring_only = path.name == "__init__.py" and body and body[-1].rstrip().endswith('"""')
            if path.name != "__init__.py" or not docstring_only:
                found.add(f"{package}/{path.relative_to(root).as_posix()}")
    return found


def test_where_the_code_lives_names_every_module_once_and_nothing_else():
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Where the code lives", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `((?:cluster_node|train|clusterops|fabfile)/[\w/]+\.py)` \| (.+) \|$", section, re.M)
    named = [name for name, what in rows if what.strip()]
    assert len(named) == len(set(named)), "a module named twice"
    modules = _package_modules()
    assert {
        "cluster_node/protocol/rundir.py",
        "fabfile/__init__.py",
        "cluster_node/daemons/autostop/watchdog.py",
    } <= modules
    assert "train/__init__.py" not in modules  # a docstring only
    assert not modules - set(named), f"name these in docs/architecture.md: {sorted(modules - set(named))}"
    assert not set(named) - modules, f"no such module: {sorted(set(named) - modules)}"


NODE_ROLE_LIST = "The node role's statements, every one"
ACTION = re.compile(r"`([a-z0-9-]+:[A-Z][A-Za-z]+)`")


def _node_role_statements(template: dict) -> list[frozenset[str]]:
    """The node role's policy statements' action sets, as synthesized."""
    found = []
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::IAM::Policy" and "NodeRole" in name:
            for statement in resource["Properties"]["PolicyDocument"]["Statement"]:
                actions = statement["Action"]
                found.append(frozenset([actions] if isinstance(actions, str) else actions))
    return found


def test_the_node_roles_statement_list_in_the_docs_is_the_synthesized_one():
    """Issue 28 §9: docs/operations.md said the role could only signal, publish its host key, read two
    parameters and keep Session Manager's channels; it also stops, describes, publishes metrics, resets alarms
    and reads CloudWatch. The golden template is the synthesized one (test_templates_golden holds it so)."""
    import json

    text = (REPO / "docs" / "operations.md").read_text()
    assert NODE_ROLE_LIST in text
    bullets = text.split(NODE_ROLE_LIST, 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    documented = [frozenset(ACTION.findall(line)) for line in bullets if line.startswith("- ")]
    assert documented and all(documented), bullets
    synthesized = _node_role_statements(json.loads((REPO / "tests" / "golden" / "default.template.json").read_text()))
    assert synthesized, "no node role policy in the golden template"
    documented_actions, granted = set().union(*documented), set().union(*synthesized)
    assert documented_actions == granted, (
        f"granted, not documented: {sorted(granted - documented_actions)}; "
        f"documented, not granted: {sorted(documented_actions - granted)}"
    )


def test_the_first_aws_run_says_what_a_first_deploy_takes_and_what_to_do_when_it_fails():
    """Issue 32 §12: no total deploy time, nothing on the 45 minutes CloudFormation waits for a bootstrap
    (billing), --no-rollback, what a rollback leaves, `fab audit` after a failed deploy, `cdk bootstrap`
    or the days a quota increase can take."""
    from stacks.nodes import BOOTSTRAP_TIMEOUT

    minutes = int(BOOTSTRAP_TIMEOUT.to_minutes())
    script = (REPO / "assets" / "bootstrap" / "node-bootstrap.sh").read_text()
    assert f"FAILED_STOP_MINUTES={minutes}\n" in script  # the failed node's own stop: the same 45 min
    readme = (REPO / "README.md").read_text()
    first = readme[readme.index("## The first AWS run") : readme.index("## Deploy readiness")]
    timed = (REPO / "docs" / "operations.md").read_text().split("### The first deploy, timed")[1].split("\n## ")[0]
    for text in (first, timed):
        for words in ("cdk bootstrap", "--no-rollback", f"{minutes} min", "fab audit", "days", "~10-20 min"):
            assert words in text, words
