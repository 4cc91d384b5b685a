#!/usr/bin/python3
"""node-deps.py: the dependency graph between the modules of dataplane/node/.

    node-deps.py BUILD_DIR [--allow FILE] [--verbose]
    node-deps.py --self-test

A module is one .c file of dataplane/node/ (with its own .h when it has one);
the files of dataplane/node/core/ together are one module, "core". Module A
depends on module B when A uses a function or a global that B defines. The
method is exact and cheap: `nm` reads the object files the build left in
BUILD_DIR/dataplane/node/; an undefined symbol of A's object that a defined
(global) symbol of B's object resolves is an edge A -> B. Static functions
and static data are private to their file and never make an edge; a symbol
that no module of the node defines (libc, gRPC, the transport library) is
outside the graph. Only objects whose source file still exists count, so an
object left behind by a removed file does not add edges.

It prints every module with the modules it uses (--verbose: and the symbols),
then the cycles (strongly connected components of more than one module), and
checks them against the allowlist (default: dataplane/node/deps-allow.txt).
Each line of the allowlist names one back edge, "A -> B  # why". The check
fails (exit 1) when
  - the graph without the listed edges still has a cycle (a new circle), or
  - a listed edge no longer exists, or no longer lies on a cycle (the list
    must stay true: remove the line).
Exit 2: bad usage, an unreadable allowlist, or no object files found.
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC_NODE = os.path.normpath(os.path.join(HERE, "..", "dataplane", "node"))
DEFAULT_ALLOW = os.path.join(SRC_NODE, "deps-allow.txt")


def module_of(rel_src):
    """The module of a source path relative to dataplane/node/."""
    parts = rel_src.split(os.sep)
    if len(parts) > 1 and parts[0] == "core":
        return "core"
    if len(parts) > 1:
        return None  # another folder: not a module of the node
    return parts[0][: -len(".c")]


def find_objects(build_dir):
    """{module: [object paths]} for the node's sources that exist now.

    CMake names an object of src/x.c CMakeFiles/<target>.dir/x.c.o, in the
    build folder that mirrors the source folder."""
    root = os.path.join(build_dir, "dataplane", "node")
    found = {}
    for dirpath, _dirs, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = rel_dir.split(os.sep)
        if "CMakeFiles" not in parts:
            continue
        i = parts.index("CMakeFiles")
        if i + 1 >= len(parts) or not parts[i + 1].endswith(".dir"):
            continue
        src_dir = parts[:i]  # the source folder this build folder mirrors
        sub = parts[i + 2 :]  # a source in a sub-folder of it
        for f in files:
            if not f.endswith(".c.o"):
                continue
            rel_src = os.path.join(*(src_dir + sub + [f[: -len(".o")]]))
            rel_src = os.path.normpath(rel_src)
            if not os.path.isfile(os.path.join(SRC_NODE, rel_src)):
                continue  # left behind by a file that is gone
            mod = module_of(rel_src)
            if mod:
                found.setdefault(mod, []).append(os.path.join(dirpath, f))
    return found


def read_symbols(path):
    """(defined, undefined) global symbol sets of one object file (nm -P)."""
    out = subprocess.run(
        ["nm", "-g", "-P", path], check=True, capture_output=True, text=True
    ).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        f = line.split()
        if len(f) < 2:
            continue
        name, kind = f[0], f[1]
        if kind in ("U", "w", "v"):
            undefined.add(name)
        else:
            defined.add(name)
    return defined, undefined


def build_graph(symbols):
    """symbols: {module: (defined, undefined)} -> {A: {B: sorted symbols}}."""
    owner = {}
    for mod, (defined, _) in symbols.items():
        for s in defined:
            owner[s] = mod
    graph = {mod: {} for mod in symbols}
    for mod, (_, undefined) in symbols.items():
        for s in undefined:
            b = owner.get(s)
            if b is not None and b != mod:
                graph[mod].setdefault(b, []).append(s)
    for mod in graph:
        for b in graph[mod]:
            graph[mod][b].sort()
    return graph


def sccs(nodes, edges):
    """Tarjan's strongly connected components. edges: {a: iterable of b}."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def cycles(graph, drop=()):
    """The strongly connected components of more than one module of graph
    without the edges in drop."""
    edges = {a: [b for b in bs if (a, b) not in drop] for a, bs in graph.items()}
    return [c for c in sccs(graph.keys(), edges) if len(c) > 1]


def parse_allow(text, name="allowlist"):
    """[(a, b, reason)]; raises ValueError naming the line."""
    out = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        edge, sep, reason = line.partition("#")
        a, arrow, b = edge.partition("->")
        a, b, reason = a.strip(), b.strip(), reason.strip()
        if not arrow or not a or not b or " " in a or " " in b:
            raise ValueError(f'{name}:{no}: expected "A -> B  # why", got: {raw}')
        if not sep or not reason:
            raise ValueError(f"{name}:{no}: {a} -> {b} has no reason (# why)")
        out.append((a, b, reason))
    return out


def check(graph, allow):
    """The problems of graph against the allowlist: a list of strings."""
    problems = []
    listed = {(a, b) for a, b, _ in allow}
    in_cycle = {}
    for i, comp in enumerate(cycles(graph)):
        for m in comp:
            in_cycle[m] = i
    for a, b, _ in allow:
        if b not in graph.get(a, {}):
            problems.append(f"allowlisted edge {a} -> {b} no longer exists: remove it")
        elif in_cycle.get(a) is None or in_cycle.get(a) != in_cycle.get(b):
            problems.append(
                f"allowlisted edge {a} -> {b} is no longer on a cycle: remove it"
            )
    for comp in cycles(graph, listed):
        inside = [
            f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp
        ]
        problems.append(
            "a cycle the allowlist does not cover: "
            + ", ".join(comp)
            + " (edges: "
            + "; ".join(inside)
            + ")"
        )
    return problems


def figures(graph, allow):
    comps = cycles(graph)
    where = {m: i for i, c in enumerate(comps) for m in c}
    nedges = sum(len(bs) for bs in graph.values())
    cyc_edges = sum(
        1
        for a, bs in graph.items()
        for b in bs
        if a in where and where[a] == where.get(b)
    )
    return {
        "modules": len(graph),
        "edges": nedges,
        "cycles": len(comps),
        "modules_in_cycles": len(where),
        "edges_in_cycles": cyc_edges,
        "allowlisted": len(allow),
    }


def report(graph, allow, verbose, out=sys.stdout):
    print("dataplane/node modules and what each uses:", file=out)
    for a in sorted(graph):
        uses = sorted(graph[a])
        print(f"  {a} -> {', '.join(uses) if uses else '(nothing)'}", file=out)
        if verbose:
            for b in uses:
                print(f"      {b}: {' '.join(graph[a][b])}", file=out)
    comps = cycles(graph)
    print(f"cycles (strongly connected components): {len(comps)}", file=out)
    for comp in comps:
        print("  " + ", ".join(comp), file=out)
    f = figures(graph, allow)
    print(
        "figures: {modules} modules, {edges} edges, {cycles} cycles of "
        "{modules_in_cycles} modules, {edges_in_cycles} edges inside cycles, "
        "{allowlisted} allowlisted back edges".format(**f),
        file=out,
    )


def self_test():
    """The check's own cases on made-up graphs: each must come out as said."""
    def g(*edges):
        graph = {}
        for e in edges:
            a, b = e.split(">")
            graph.setdefault(a, {})[b] = ["sym"]
            graph.setdefault(b, {})
        return graph

    def allow(*edges):
        return [(e.split(">")[0], e.split(">")[1], "test") for e in edges]

    cases = [
        ("a chain has no cycle", g("a>b", "b>c"), allow(), 0),
        ("a two-module circle is caught", g("a>b", "b>a"), allow(), 1),
        ("its back edge listed: fine", g("a>b", "b>a"), allow("b>a"), 0),
        ("a three-module circle is caught", g("a>b", "b>c", "c>a"), allow(), 1),
        ("a listed edge that is gone fails", g("a>b"), allow("b>a"), 1),
        ("a listed edge off every cycle fails", g("a>b", "b>c", "c>b"), allow("c>b", "a>b"), 1),
        ("two circles, one listed: fails", g("a>b", "b>a", "c>d", "d>c"), allow("b>a"), 1),
        ("a second way round the circle fails", g("a>b", "b>a", "b>c", "c>a"), allow("b>a"), 1),
        ("both ways listed: fine", g("a>b", "b>a", "b>c", "c>a"), allow("b>a", "c>a"), 0),
    ]
    bad = 0
    for name, graph, al, want in cases:
        got = len(check(graph, al))
        ok = (got == 0) == (want == 0)
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
        bad += not ok
    for text in ["a -> b", "a b  # x", "-> b # x", "a -> # x"]:
        try:
            parse_allow(text)
            print(f"FAIL the allowlist line {text!r} is refused")
            bad += 1
        except ValueError:
            print(f"ok   the allowlist line {text!r} is refused")
    sym = {
        "x": ({"x_f", "shared"}, {"y_g", "printf"}),
        "y": ({"y_g"}, {"x_f"}),
        "z": ({"z_h"}, {"nothing_defines_me"}),
    }
    graph = build_graph(sym)
    ok = graph == {"x": {"y": ["y_g"]}, "y": {"x": ["x_f"]}, "z": {}}
    print(f"{'ok  ' if ok else 'FAIL'} symbols resolve to the module that defines them")
    bad += not ok
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir", nargs="?", help="a configured and built build folder")
    ap.add_argument("--allow", default=DEFAULT_ALLOW, help="the allowlist of back edges")
    ap.add_argument("--verbose", action="store_true", help="name the symbols of each edge")
    ap.add_argument("--self-test", action="store_true", help="check the checker")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.build_dir:
        ap.error("BUILD_DIR is required")
    try:
        with open(args.allow, encoding="utf-8") as f:
            allow = parse_allow(f.read(), args.allow)
    except (OSError, ValueError) as e:
        print(f"node-deps: {e}", file=sys.stderr)
        return 2
    objects = find_objects(args.build_dir)
    if not objects:
        print(
            f"node-deps: no object files of dataplane/node under {args.build_dir}: build it first",
            file=sys.stderr,
        )
        return 2
    symbols = {}
    for mod, paths in objects.items():
        defined, undefined = set(), set()
        for p in paths:
            d, u = read_symbols(p)
            defined |= d
            undefined |= u
        symbols[mod] = (defined, undefined - defined)
    graph = build_graph(symbols)
    report(graph, allow, args.verbose)
    problems = check(graph, allow)
    for p in problems:
        print(f"node-deps: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
