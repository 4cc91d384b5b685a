// Helpers of the deployment tests: the rendered object sets, and what the
// daemons are told (their effective settings, like kvf_config.c computes them:
// command line > environment > config file > default).
import { readFileSync, readdirSync, existsSync } from "node:fs";
import { join } from "node:path";
import { execFileSync } from "node:child_process";
import { parseAllDocuments } from "yaml";

export const RENDERED = process.env.KVF_DEPLOY_RENDERED;
export const ROOT = process.env.KVF_REPO_ROOT;
export const BUILD = process.env.KVF_BUILD_DIR;
if (!RENDERED || !ROOT) throw new Error("run through tests/deploy/run.sh");

export function renders() {
  return readdirSync(RENDERED)
    .filter((f) => f.endsWith(".yaml"))
    .sort()
    .map((f) => {
      const docs = parseAllDocuments(readFileSync(join(RENDERED, f), "utf8"));
      for (const d of docs) if (d.errors.length) throw new Error(`${f}: ${d.errors[0].message}`);
      const objects = docs.map((d) => d.toJS()).filter((o) => o && typeof o === "object");
      const notesPath = join(RENDERED, f.replace(/\.yaml$/, ".notes.txt"));
      return { name: f.replace(/\.yaml$/, ""), objects, notes: existsSync(notesPath) ? readFileSync(notesPath, "utf8") : null };
    });
}

export const ofKind = (r, kind) => r.objects.filter((o) => o.kind === kind);
export function one(r, kind) {
  const l = ofKind(r, kind);
  if (l.length !== 1) throw new Error(`${r.name}: ${l.length} ${kind} objects, want 1`);
  return l[0];
}
export const byName = (r, kind, name) => ofKind(r, kind).find((o) => o.metadata.name === name);

// The port of "host:port", "[v6]:port" or a bare port.
export function portOf(addr) {
  const m = /(?:^|:)(\d+)$/.exec(String(addr));
  if (!m) throw new Error(`no port in '${addr}'`);
  return Number(m[1]);
}
export const hostOf = (addr) => String(addr).replace(/:\d+$/, "");

// --name value / --name=value pairs of a command line.
export function parseArgs(argv) {
  const out = {};
  for (let i = 0; i < argv.length; i++) {
    const a = String(argv[i]);
    if (!a.startsWith("--")) continue;
    const eq = a.indexOf("=");
    if (eq > 0) out[a.slice(2, eq)] = a.slice(eq + 1);
    else if (i + 1 < argv.length && !String(argv[i + 1]).startsWith("--")) out[a.slice(2)] = String(argv[++i]);
    else out[a.slice(2)] = "true";
  }
  return out;
}

export function parseConfigFile(text) {
  const out = {};
  for (const raw of text.split("\n")) {
    const line = raw.replace(/#.*$/, "").trim();
    if (!line) continue;
    const eq = line.indexOf("=");
    if (eq < 0) throw new Error(`config line without '=': ${raw}`);
    out[line.slice(0, eq).trim()] = line.slice(eq + 1).trim();
  }
  return out;
}

// The file a container sees at `path`, when it comes from a ConfigMap.
function configMapFile(r, podSpec, container, path) {
  for (const m of container.volumeMounts ?? []) {
    const vol = (podSpec.volumes ?? []).find((v) => v.name === m.name);
    if (!vol?.configMap) continue;
    const cm = byName(r, "ConfigMap", vol.configMap.name);
    if (!cm) throw new Error(`${r.name}: ConfigMap ${vol.configMap.name} not rendered`);
    if (m.subPath && m.mountPath === path) return cm.data[m.subPath];
    if (!m.subPath && path.startsWith(m.mountPath + "/")) return cm.data[path.slice(m.mountPath.length + 1)];
  }
  return undefined;
}

const envName = (prefix, name) => prefix + name.toUpperCase().replace(/-/g, "_");

// A container's environment as the kubelet gives it: downward-API values come
// back as {fieldRef: ...}; "$(NAME)" in a value is replaced by NAME's value
// when NAME is defined earlier, a downward-API value as "{status.podIP}".
export function envOf(container) {
  const env = {};
  for (const e of container.env ?? []) {
    if (e.value === undefined) {
      env[e.name] = e.valueFrom;
      continue;
    }
    env[e.name] = String(e.value).replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, name) => {
      const v = env[name];
      if (v === undefined) return m;
      return typeof v === "string" ? v : `{${v.fieldRef?.fieldPath ?? JSON.stringify(v)}}`;
    });
  }
  return env;
}

// Effective settings of a daemon container. Env values from the downward API
// come back as {fieldRef: ...}.
export function settings(r, podSpec, container, prefix, defaults = {}) {
  const args = parseArgs([...(container.command ?? []).slice(1), ...(container.args ?? [])]);
  const env = envOf(container);
  let file = {};
  const cfgPath = args.config ?? env[prefix + "CONFIG"];
  if (cfgPath) {
    const text = configMapFile(r, podSpec, container, cfgPath);
    if (text === undefined) throw new Error(`${r.name}: --config ${cfgPath} is not mounted from a ConfigMap`);
    file = parseConfigFile(text);
  }
  const out = { ...defaults, ...file };
  for (const [k, v] of Object.entries(env)) {
    if (k.startsWith(prefix)) out[k.slice(prefix.length).toLowerCase().replace(/_/g, "-")] = v;
  }
  Object.assign(out, args);
  out.__file = file;
  return out;
}

// The control plane: the StatefulSet's container and its settings.
export const CONTROL_DEFAULTS = { listen: "127.0.0.1:7070", "metrics-listen": "127.0.0.1:9464" };
export function control(r) {
  const sts = one(r, "StatefulSet");
  const spec = sts.spec.template.spec;
  const c = spec.containers.find((x) => (x.command ?? [])[0] === "kvfence-control");
  if (!c) throw new Error(`${r.name}: no kvfence-control container`);
  return { sts, spec, c, s: settings(r, spec, c, "KVF_CONTROL_", CONTROL_DEFAULTS) };
}
export const NODE_DEFAULTS = { "local-socket": "/run/kvfence/node.sock", "drain-timeout-ms": "10000" };
export function node(r) {
  const ds = one(r, "DaemonSet");
  const spec = ds.spec.template.spec;
  const c = spec.containers.find((x) => (x.command ?? [])[0] === "kvfence-node");
  if (!c) throw new Error(`${r.name}: no kvfence-node container`);
  return { ds, spec, c, s: settings(r, spec, c, "KVF_NODE_", NODE_DEFAULTS) };
}

// A probe's or a Service's port: a number, or a container port name.
export function resolvePort(container, p) {
  if (typeof p === "number") return p;
  const cp = (container.ports ?? []).find((x) => x.name === p);
  if (!cp) throw new Error(`port name '${p}' is not a port of container ${container.name}`);
  return cp.containerPort;
}

export const matches = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v) && Object.keys(selector ?? {}).length > 0;

// Kubernetes quantities, as numbers (cpu in cores, memory in bytes).
export function quantity(q) {
  const m = /^([0-9.]+)([a-zA-Z]*)$/.exec(String(q));
  if (!m) throw new Error(`bad quantity ${q}`);
  const mult = { "": 1, m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40 }[m[2]];
  if (mult === undefined) throw new Error(`bad quantity suffix ${q}`);
  return Number(m[1]) * mult;
}

// Settings kvfence-control knows, from its --help (when it is built).
export function controlSettingNames() {
  const bin = BUILD && join(BUILD, "controlplane", "kvfence-control");
  if (!bin || !existsSync(bin)) return null;
  const help = execFileSync(bin, ["--help"], { encoding: "utf8" });
  return new Set([...help.matchAll(/^\s+--([a-z0-9-]+)/gm)].map((m) => m[1]));
}

// The pod's volume mounted at (or above) `path` in `container`, or undefined.
export function volumeAt(podSpec, container, path) {
  const m = (container.volumeMounts ?? []).find((x) => path === x.mountPath || path.startsWith(x.mountPath + "/"));
  return m && (podSpec.volumes ?? []).find((v) => v.name === m.name);
}

// Render sets that are meant to run without mutual TLS (the insecure flag).
export const isInsecureSet = (r) => /(^|-)insecure/.test(r.name);
