"""The layout of the code: decoder/'s rooms and the direction of imports between the packages.

Read from the source with `ast` (nothing is imported), every import counted, at module level and inside
functions alike:
  - decoder/ holds at most TOP_LIMIT modules at its top (__init__.py and __main__.py included);
  - no import circle among decoder's modules, nor among its rooms (the top-level modules are the room
    `decoder`; __main__.py, which imports every room, is a room of its own);
  - the rooms import one way, in ROOMS' order (each only rooms before it), the order decoder/__init__.py states;
  - the packages import one way: data <- census, data <- decoder, both <- reports (ALLOWED);
  - every sub-package of decoder has an __init__.py whose docstring says what it holds and what it may import.
Each check is a function over a graph; the synthetic graphs below show that each can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP_LIMIT = 8
ROOMS = ("decoder", "drafters", "verify", "cost", "live", "replay", "vllm", "__main__")  # decoder/__init__.py says the same
ALLOWED = {"data": set(), "census": {"data"}, "decoder": {"data"}, "reports": {"data", "census", "decoder"}}


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every name `source` imports, anywhere in it (inside functions too), relative imports made absolute;
    `from X import Y` gives X and X.Y (Y may be a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def module_graph(package: str, root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (a name resolves to its longest prefix that is a module)."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py")) if "__pycache__" not in p.parts}
    graph = {}
    for name, path in files.items():
        deps = set()
        for imported in imports_of(path.read_text(), name, path.name == "__init__.py"):
            parts = imported.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            if parts and ".".join(parts) != name:
                deps.add(".".join(parts))
        graph[name] = deps
    return graph


def sub_packages(package_dir: Path) -> set[str]:
    """The folders of `package_dir` that hold Python modules: its rooms."""
    return {p.name for p in package_dir.iterdir() if p.is_dir() and any(p.glob("*.py"))}


def room_of(module: str, rooms: set[str]) -> str:
    """decoder.verify and decoder.verify.engine -> verify (a sub-package of `rooms`); decoder.loop and decoder
    itself -> decoder (the top level); decoder.__main__ -> __main__ (a room of its own)."""
    parts = module.split(".")
    if parts[1:2] == ["__main__"]:
        return "__main__"
    return parts[1] if len(parts) > 1 and parts[1] in rooms else "decoder"


def room_graph(graph: dict[str, set[str]], rooms: set[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, deps in graph.items():
        ra = room_of(a, rooms)
        out.setdefault(ra, set()).update(room_of(b, rooms) for b in deps if room_of(b, rooms) != ra)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle of `graph` (its first node repeated at its end), or None: from each node, by brute force,
    a search for a way back to it."""
    for start in sorted(graph):
        paths, seen = [[start]], set()
        while paths:
            path = paths.pop()
            for nxt in sorted(graph.get(path[-1], ())):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append(path + [nxt])
    return None


def order_violations(rooms: dict[str, set[str]], order: tuple[str, ...]) -> list[tuple[str, str]]:
    """(room, room it imports) for every import that is not of a room before it in `order` (an unknown room too)."""
    rank = {r: i for i, r in enumerate(order)}
    return sorted((a, b) for a, deps in rooms.items() for b in deps
                  if a not in rank or b not in rank or rank[b] >= rank[a])


def package_imports(package: str, root: Path = REPO) -> set[str]:
    """The packages of ALLOWED that `package` imports, itself left out."""
    out = set()
    for p in (root / package).rglob("*.py"):
        name = module_name(p, root)
        out.update(n.split(".")[0] for n in imports_of(p.read_text(), name, p.name == "__init__.py"))
    return (out & set(ALLOWED)) - {package}


def direction_violations(imported: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in imported.items() for b in deps if b not in allowed.get(a, set()))


def top_modules(package_dir: Path) -> list[str]:
    return sorted(p.name for p in package_dir.glob("*.py"))


def undocumented_rooms(package_dir: Path) -> list[str]:
    """Sub-packages (folders holding .py files) without an __init__.py whose docstring says what it may import."""
    bad = []
    for d in sorted(p for p in package_dir.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        if not any(d.glob("*.py")):
            continue
        init = d / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        if not doc or "May import" not in doc:
            bad.append(str(d.relative_to(package_dir.parent)))
    return bad


def stated_order(init: Path) -> tuple[str, ...]:
    """The room order as decoder/__init__.py's docstring writes it: the line `decoder (top level) <- drafters <- ...`."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    lines = [line for line in doc.splitlines() if " <- " in line]
    assert len(lines) == 1, f"{init}: one line of the room order (a <- b <- c), found {len(lines)}"
    return tuple(part.split("(")[0].strip() for part in lines[0].split("<-"))


# --- the repository


def test_decoder_top_holds_few_modules():
    top = top_modules(REPO / "decoder")
    assert len(top) <= TOP_LIMIT, f"decoder/ holds {len(top)} modules at its top (at most {TOP_LIMIT}): {top}"


def test_decoder_graph_is_read():
    graph = module_graph("decoder")
    assert "decoder.loop" in graph["decoder.verify.engine"] and "decoder.pools" in graph["decoder.loop"]
    assert "decoder.live.harness" in graph["decoder.__main__"]  # an import inside a function counts


def test_no_import_circle_among_decoder_modules():
    cycle = find_cycle(module_graph("decoder"))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_rooms_import_one_way():
    rooms = room_graph(module_graph("decoder"), sub_packages(REPO / "decoder"))
    assert set(rooms) <= set(ROOMS), f"rooms not in ROOMS: {sorted(set(rooms) - set(ROOMS))}"
    cycle = find_cycle(rooms)
    assert cycle is None, "import circle among rooms: " + " -> ".join(cycle)
    bad = order_violations(rooms, ROOMS)
    assert not bad, "imports against the room order " + " <- ".join(ROOMS) + ": " + ", ".join(
        f"{a} imports {b}" for a, b in bad)


def test_room_order_is_written_once():
    assert stated_order(REPO / "decoder" / "__init__.py") == ROOMS


def test_packages_import_one_way():
    imported = {p: package_imports(p) for p in ALLOWED}
    bad = direction_violations(imported, ALLOWED)
    assert not bad, ", ".join(f"{a} imports {b}" for a, b in bad)


def test_every_room_says_what_it_holds():
    assert undocumented_rooms(REPO / "decoder") == []


# --- each check can fail


def test_imports_of_reads_lazy_and_relative_imports():
    source = "import a.b\nfrom .c import d\ndef f():\n    from decoder.verify import engine\n"
    assert imports_of(source, "decoder.x.y") == {"a.b", "decoder.x.c", "decoder.x.c.d", "decoder.verify",
                                                 "decoder.verify.engine"}
    assert "decoder.x.c" in imports_of("from .c import d\n", "decoder.x", is_package=True)


def test_find_cycle_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_room_graph_and_order_catch_an_import_back():
    graph = {"decoder.loop": {"decoder.verify.engine"}, "decoder.verify.engine": {"decoder.loop"},
             "decoder.__main__": {"decoder.replay.run"}, "decoder.replay.run": {"decoder.verify.engine"}}
    rooms = room_graph(graph, {"verify", "replay"})
    assert rooms == {"decoder": {"verify"}, "verify": {"decoder"}, "__main__": {"replay"}, "replay": {"verify"}}
    assert room_of("decoder.verify", {"verify"}) == "verify" and room_of("decoder", {"verify"}) == "decoder"
    assert find_cycle(rooms) is not None
    assert order_violations(rooms, ROOMS) == [("decoder", "verify")]
    assert order_violations({"attic": {"decoder"}}, ROOMS) == [("attic", "decoder")]


def test_direction_catches_data_importing_up():
    assert direction_violations({"data": {"decoder"}, "census": {"data"}, "decoder": {"census"}}, ALLOWED) == [
        ("data", "decoder"), ("decoder", "census")]


def test_top_limit_and_docstrings_can_fail(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "room").mkdir(parents=True)
    (pkg / "bare").mkdir()
    for i in range(TOP_LIMIT + 1):
        (pkg / f"m{i}.py").write_text("")
    (pkg / "room" / "__init__.py").write_text('"""A room.\n\nMay import: pkg."""\n')
    (pkg / "room" / "a.py").write_text("")
    (pkg / "bare" / "__init__.py").write_text("x = 1\n")
    (pkg / "bare" / "b.py").write_text("")
    (pkg / "loose").mkdir()
    (pkg / "loose" / "c.py").write_text("")
    assert len(top_modules(pkg)) == TOP_LIMIT + 1
    assert undocumented_rooms(pkg) == ["pkg/bare", "pkg/loose"]


def test_stated_order_reads_the_docstring(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text('"""Rooms.\n\n  decoder (top level) <- drafters <- vllm\n"""\n')
    assert stated_order(init) == ("decoder", "drafters", "vllm") != ROOMS
