// deploy/docker/Dockerfile, parsed: the build stage runs the README's setup
// commands, the runtime stage installs only runtime libraries of packages the
// build needs (scripts/install-deps.sh) and holds no compiler.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, existsSync } from "node:fs";
import { join } from "node:path";
import { execFileSync } from "node:child_process";
import { ROOT, BUILD } from "./lib.mjs";

function parseDockerfile(text) {
  const lines = text.replace(/\\\r?\n/g, " ").split(/\r?\n/);
  const args = {};
  const stages = [];
  for (const raw of lines) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    const [, instr, rest] = /^(\w+)\s+(.*)$/.exec(line) ?? [];
    if (!instr) continue;
    const I = instr.toUpperCase();
    const subst = (s) => s.replace(/\$\{(\w+)\}|\$(\w+)/g, (m, a, b) => args[a ?? b] ?? m);
    if (I === "ARG" && !stages.length) {
      const [k, v] = rest.split("=");
      args[k.trim()] = v?.trim();
    } else if (I === "FROM") {
      const [, image, name] = /^(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?/i.exec(rest);
      stages.push({ image: subst(image), name, instrs: [] });
    } else {
      assert.ok(stages.length, `${I} before FROM`);
      stages.at(-1).instrs.push({ I, rest: rest.replace(/\s+/g, " ").trim() });
    }
  }
  return stages;
}

// Packages named by `apt-get install` in a RUN line.
function aptInstalls(run) {
  const out = [];
  for (const cmd of run.split(/&&|;|\|\|/)) {
    const w = cmd.trim().split(/\s+/);
    const i = w.findIndex((x, k) => /apt(-get)?$/.test(x) && w[k + 1] === "install");
    if (i < 0) continue;
    out.push(...w.slice(i + 2).filter((x) => !x.startsWith("-") && !x.includes("=")));
  }
  return out;
}

function installDepsPackages() {
  const s = readFileSync(join(ROOT, "scripts/install-deps.sh"), "utf8");
  const block = /packages=\(([\s\S]*?)\n\)/.exec(s)[1];
  return block.split("\n").map((l) => l.replace(/#.*$/, "").trim()).join(" ").split(/\s+/).filter(Boolean);
}

// Direct Depends of a Debian package (apt-cache, or this fallback without it).
const FALLBACK_DEPENDS = {
  "libgrpc-dev": ["libgrpc29"], "libprotobuf-c-dev": ["libprotobuf-c1"], "libzmq3-dev": ["libzmq5"],
  "libibverbs-dev": ["libibverbs1", "ibverbs-providers"], "libmicrohttpd-dev": ["libmicrohttpd12"],
  "libssl-dev": ["libssl3"],
};
let aptDepends = null; // package -> its direct Depends, from one apt-cache call
function loadDepends(pkgs) {
  try {
    const out = execFileSync("apt-cache", ["depends", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", ...pkgs], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] });
    aptDepends = {};
    let cur = null;
    for (const line of out.split("\n")) {
      if (/^\S/.test(line)) aptDepends[(cur = line.trim())] = [];
      else if (cur) {
        const m = /^\s+(?:\|)?(?:Pre)?Depends: <?([^\s>:]+)/.exec(line);
        if (m) aptDepends[cur].push(m[1]);
      }
    }
  } catch {
    aptDepends = null;
  }
}
function depends(pkg) {
  return aptDepends?.[pkg] ?? FALLBACK_DEPENDS[pkg] ?? [];
}

const dockerfile = readFileSync(join(ROOT, "deploy/docker/Dockerfile"), "utf8");
const stages = parseDockerfile(dockerfile);
const build = stages.find((s) => s.name === "build");
const runtime = stages.at(-1);
const runs = (st) => st.instrs.filter((x) => x.I === "RUN").map((x) => x.rest);

test("two stages on Debian 12, pinned", () => {
  assert.ok(build, "no stage named build");
  assert.notEqual(runtime, build, "the last stage must be the runtime stage");
  for (const st of stages) {
    assert.match(st.image, /^(docker\.io\/(library\/)?)?debian:(12|bookworm)[\w.-]*(@sha256:[0-9a-f]{64})?$/, `base image ${st.image}`);
    assert.ok(!/:latest/.test(st.image));
  }
});

test("the build stage runs the README's setup commands", () => {
  const readme = readFileSync(join(ROOT, "README.md"), "utf8");
  const section = /## Building by hand[\s\S]*?```sh\n([\s\S]*?)```/.exec(readme)[1];
  const want = section.split("\n").map((l) => l.replace(/#.*$/, "").trim()).filter((l) => l && !/SANITIZE|asan/.test(l))
    .flatMap((l) => l.split("&&").map((x) => x.trim())).filter((l) => /^(scripts\/install-deps\.sh|cmake )/.test(l));
  const norm = (c) => c.replace(/^bash\s+/, "").replace(/\s+-D\S+/g, "").replace(/\s+-j\s*("?\$\(nproc\)"?|\d+)?$/, " -j").trim();
  const got = runs(build).map(norm);
  assert.ok(want.length >= 3, `README commands: ${want}`);
  for (const w of want) assert.ok(got.includes(norm(w)), `build stage lacks '${w}' (has ${JSON.stringify(got)})`);
  assert.ok(runs(build).some((r) => /-DKVF_WITH_CUDA=OFF/.test(r)), "CUDA parts off in the image build");
  assert.deepEqual(runs(build).flatMap(aptInstalls), [], "the build stage installs packages only through scripts/install-deps.sh");
});

test("the runtime stage installs only runtime libraries of packages the build needs", () => {
  const need = installDepsPackages();
  assert.ok(need.includes("libgrpc-dev"), "install-deps.sh parsed");
  loadDepends(need);
  const allowed = new Map();
  for (const p of need) for (const d of depends(p)) if (!allowed.has(d)) allowed.set(d, p);
  const pkgs = runs(runtime).flatMap(aptInstalls);
  assert.ok(pkgs.length > 0, "the runtime stage installs the shared libraries");
  for (const p of pkgs) assert.ok(allowed.has(p), `runtime package ${p} is not a dependency of any package in install-deps.sh`);
  // Every library package the daemons link has its runtime side.
  for (const dev of ["libgrpc-dev", "libprotobuf-c-dev", "libzmq3-dev", "libibverbs-dev", "libmicrohttpd-dev",
                     "libssl-dev"])
    assert.ok(depends(dev).some((d) => pkgs.includes(d)), `no runtime library of ${dev} in the runtime stage`);
});

test("the runtime stage holds no compiler or build tool", () => {
  const pkgs = runs(runtime).flatMap(aptInstalls);
  const bad = /^(gcc|g\+\+|cpp|clang|llvm|build-essential|cmake|make|binutils|pkg-?conf|protobuf-(c-)?compiler|nodejs|npm)(-[\d.]+)?$|-dev$/;
  for (const p of pkgs) assert.ok(!bad.test(p), `runtime installs ${p}`);
  for (const r of runs(runtime)) assert.ok(!/install-deps\.sh|cmake|\bgcc\b|\bcc\b|\bmake\b/.test(r), `runtime RUN: ${r}`);
  for (const x of runtime.instrs.filter((i) => i.I === "COPY")) {
    const from = /--from=(\S+)/.exec(x.rest)?.[1];
    if (from) {
      assert.equal(from, "build");
      assert.match(x.rest, /^--from=build \/out\/bin\/? \S+$/, `COPY from the build stage takes only the collected binaries: ${x.rest}`);
    } else assert.fail(`runtime COPY from the context: ${x.rest}`);
  }
});

test("the daemons' shared libraries are all in the runtime stage", { skip: !existsSync(join(BUILD ?? "", "controlplane/kvfence-control")) && "binaries not built" }, () => {
  let closure;
  const pkgs = runs(runtime).flatMap(aptInstalls);
  try {
    const out = execFileSync("apt-cache", ["depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", ...pkgs], { encoding: "utf8", maxBuffer: 64 << 20 });
    closure = new Set([...pkgs, ...[...out.matchAll(/^\s+(?:\|)?(?:Pre)?Depends: <?([^\s>:]+)/gm)].map((m) => m[1])]);
  } catch {
    return; // no apt-cache: nothing to compare with
  }
  for (const bin of ["controlplane/kvfence-control", "dataplane/kvfence-node"]) {
    const path = join(BUILD, bin);
    if (!existsSync(path)) continue;
    const libs = [...execFileSync("ldd", [path], { encoding: "utf8" }).matchAll(/=> (\/\S+)/g)].map((m) => m[1]);
    for (const lib of libs) {
      // The image is built with -DKVF_WITH_CUDA=OFF; a local build that found
      // the CUDA toolkit links its runtime, which no Debian package ships.
      if (lib.startsWith("/usr/local/cuda")) continue;
      let owner;
      try {
        owner = execFileSync("dpkg", ["-S", execFileSync("readlink", ["-f", lib], { encoding: "utf8" }).trim()], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] });
      } catch {
        owner = execFileSync("dpkg", ["-S", lib], { encoding: "utf8" });
      }
      const pkg = owner.split(":")[0].trim();
      assert.ok(closure.has(pkg), `${bin} loads ${lib} (${pkg}), which the runtime stage does not install`);
    }
  }
});

test("non-root user, labels, .dockerignore", () => {
  const user = runtime.instrs.filter((i) => i.I === "USER").at(-1)?.rest;
  assert.ok(user && !/^(0|root)(:|$)/.test(user), `runtime USER ${user}`);
  const labels = runtime.instrs.filter((i) => i.I === "LABEL").map((i) => i.rest).join(" ");
  for (const l of ["title", "version", "source", "revision"]) assert.match(labels, new RegExp(`org\\.opencontainers\\.image\\.${l}=`));
  const ignore = readFileSync(join(ROOT, ".dockerignore"), "utf8").split("\n").map((l) => l.trim());
  for (const p of [".git", "build", "build-*"]) assert.ok(ignore.includes(p), `.dockerignore lacks ${p}`);
  // What the build stage copies must not be ignored.
  for (const p of ["scripts", "CMakeLists.txt", "api", "common", "controlplane", "dataplane"]) assert.ok(!ignore.includes(p), `.dockerignore drops ${p}`);
});
