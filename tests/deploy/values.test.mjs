// "Every value does something or is gone": each value of the chart's
// values.yaml has a row in the values table of deploy/helm/kvfence/README.md
// (itself or a parent: a row for `node.resources` covers its requests and
// limits), every row names a value that exists, with the default values.yaml
// gives it, and changing a row's value changes what the chart renders.
//
// "Changes what the chart renders" is tested by rendering, not by reading the
// templates: for each row, the value is changed (a flag flipped, a number
// moved, a string or list or map extended) and the chart is rendered again
// with helm template, first with the defaults, then with each option set of
// ci/ (some values matter only with others: node.runAsUser with
// runAsNonRoot). The chart is rendered from a copy without values.schema.json,
// so that a value the schema pins (controlPlane.replicas: 1) is still seen to
// reach the objects; the schema itself is checked by run.sh and schema tests.
// A render that fails (a template's `fail`) counts as a change.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync, mkdtempSync, cpSync, rmSync } from "node:fs";
import { join } from "node:path";
import { tmpdir } from "node:os";
import { execFileSync } from "node:child_process";
import { parse } from "yaml";
import { ROOT } from "./lib.mjs";

const HELM = process.env.KVF_HELM;
if (!HELM) throw new Error("KVF_HELM: run through tests/deploy/run.sh BUILD values");
const CHART = join(ROOT, "deploy/helm/kvfence");
const values = parse(readFileSync(join(CHART, "values.yaml"), "utf8"));
const readme = readFileSync(join(CHART, "README.md"), "utf8");

// Leaves of values.yaml: scalars, lists and empty maps.
function leaves(obj, prefix = "") {
  const out = [];
  for (const [k, v] of Object.entries(obj)) {
    const p = prefix ? `${prefix}.${k}` : k;
    if (v !== null && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length > 0) out.push(...leaves(v, p));
    else out.push(p);
  }
  return out;
}
const get = (path) => path.split(".").reduce((o, k) => (o === undefined || o === null ? undefined : o[k]), values);

// The README's values table: rows "| `path` | `default` | what it does |".
function table() {
  const rows = new Map();
  const start = readme.indexOf("| value | default |");
  assert.ok(start >= 0, "README.md has no '| value | default | ... |' table");
  for (const line of readme.slice(start).split("\n").slice(2)) {
    if (!line.startsWith("|")) break;
    const cells = line.split(/(?<!\\)\|/).slice(1, -1).map((c) => c.trim());
    const m = /^`([A-Za-z0-9_.]+)`$/.exec(cells[0] ?? "");
    assert.ok(m, `README values table: first cell of '${line}' is not a \`value.path\``);
    assert.ok(!rows.has(m[1]), `README values table: ${m[1]} twice`);
    rows.set(m[1], { def: cells[1] ?? "", what: cells[2] ?? "" });
  }
  return rows;
}
const rows = table();

test("every value of values.yaml has a row in the README's values table (itself or a parent)", () => {
  const missing = leaves(values).filter((leaf) => {
    const parts = leaf.split(".");
    return !parts.some((_, i) => rows.has(parts.slice(0, i + 1).join(".")));
  });
  assert.deepEqual(missing, [], `values without a README row: ${missing.join(", ")}`);
});

test("every README row names a value of values.yaml, with its default and a description", () => {
  for (const [path, row] of rows) {
    const v = get(path);
    assert.notEqual(v, undefined, `README row ${path}: no such value in values.yaml`);
    assert.ok(row.what.length >= 10, `README row ${path}: no description`);
    const m = /^`(.*)`$/.exec(row.def);
    assert.ok(m, `README row ${path}: default '${row.def}' is not in backticks`);
    if (v === null || typeof v !== "object" || Object.keys(v).length === 0) {
      const want = typeof v === "string" ? JSON.stringify(v) : JSON.stringify(v);
      const have = m[1];
      // Strings are written bare unless empty ("").
      assert.ok(have === want || (typeof v === "string" && v !== "" && have === v),
        `README row ${path}: default ${have}, values.yaml has ${want}`);
    }
  }
});

// Changes of a value, as --set-json takes them. Booleans are tried both ways
// (an option set may already have flipped one); numbers move far enough to
// survive a division (startupSeconds / 5).
function changes(v) {
  if (typeof v === "boolean") return [!v, v];
  return [changed(v)];
}
function changed(v) {
  if (typeof v === "number") return v * 2 + 1;
  if (typeof v === "string") return v === "" ? "kvf-test" : `${v}-kvf-test`;
  if (Array.isArray(v)) return v.length ? v.slice(1) : ["kvf-test"];
  if (v && typeof v === "object") return { ...v, "kvf-test": "1" };
  return "kvf-test";
}

const work = mkdtempSync(join(tmpdir(), "kvf-values-"));
const chart = join(work, "kvfence");
cpSync(CHART, chart, { recursive: true });
rmSync(join(chart, "values.schema.json"));
const contexts = [[], ...readdirSync(join(CHART, "ci")).filter((f) => f.endsWith("-values.yaml")).sort()
  .map((f) => ["-f", join(CHART, "ci", f)])];

function render(extra) {
  try {
    return execFileSync(HELM, ["template", "kvfence", chart, "--namespace", "kvfence", ...extra],
      { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  } catch (e) {
    return `RENDER FAILED: ${e.stderr}`;
  }
}
const baselines = contexts.map((c) => render(c));
test("the chart renders from the copy in every context", () => {
  for (const [i, b] of baselines.entries()) assert.doesNotMatch(b, /^RENDER FAILED/, `context ${contexts[i].join(" ") || "defaults"}: ${b}`);
});

test("every value in the README table changes what the chart renders", () => {
  const idle = [];
  for (const path of rows.keys()) {
    const v = get(path);
    if (v === undefined) continue; // reported above
    const used = changes(v).some((x) => {
      const set = ["--set-json", `${path}=${JSON.stringify(x)}`];
      return contexts.some((c, i) => render([...c, ...set]) !== baselines[i]);
    });
    if (!used) idle.push(path);
  }
  assert.deepEqual(idle, [], `values that change nothing (use them in a template, or remove them): ${idle.join(", ")}`);
});

test.after(() => rmSync(work, { recursive: true, force: true }));
