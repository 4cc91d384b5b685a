// The Helm chart's overrides (ci/overrides-values.yaml sets them all) and its
// `helm test` pod, on the rendered objects. What the NOTES commands and the
// test pod do against a running control plane is notes.test.mjs.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { parse } from "yaml";
import { renders, ofKind, control, node, envOf, ROOT } from "./lib.mjs";

const all = renders().filter((r) => r.name.startsWith("helm-"));
const ov = all.find((r) => r.name === "helm-overrides");
const want = parse(readFileSync(join(ROOT, "deploy/helm/kvfence/ci/overrides-values.yaml"), "utf8"));

// Every pod the chart makes: [owner, pod metadata, pod spec].
function pods(r) {
  const out = [];
  for (const o of r.objects) {
    if (o.spec?.template?.spec) out.push([o, o.spec.template.metadata, o.spec.template.spec]);
    else if (o.kind === "Pod") out.push([o, o.metadata, o.spec]);
  }
  return out;
}
const testPods = (r) => ofKind(r, "Pod").filter((p) => p.metadata.annotations?.["helm.sh/hook"] === "test");

test("the overrides set is rendered", () => assert.ok(ov, `no helm-overrides among ${all.map((r) => r.name)}`));

test("overrides: fullnameOverride names every object, nameOverride the name label", () => {
  for (const o of ov.objects) {
    assert.ok(o.metadata.name.startsWith(`${want.fullnameOverride}-`) || o.metadata.name === want.fullnameOverride,
      `${o.kind} ${o.metadata.name} is not named from fullnameOverride`);
    assert.equal(o.metadata.labels?.["app.kubernetes.io/name"], want.nameOverride, `${o.kind} ${o.metadata.name}: name label`);
  }
  // Selectors follow the name, so the Services still find the pods.
  const { sts } = control(ov);
  assert.equal(sts.spec.selector.matchLabels["app.kubernetes.io/name"], want.nameOverride);
  assert.equal(node(ov).s.control.split(".")[0], `${want.fullnameOverride}-control`, "the nodes dial the renamed Service");
});

test("overrides: podAnnotations and podLabels on every pod, the chart's own labels kept", () => {
  for (const [o, meta] of pods(ov)) {
    for (const [k, v] of Object.entries(want.podAnnotations)) assert.equal(meta.annotations?.[k], v, `${o.metadata.name}: annotation ${k}`);
    for (const [k, v] of Object.entries(want.podLabels))
      if (!k.startsWith("app.kubernetes.io/")) assert.equal(meta.labels?.[k], v, `${o.metadata.name}: label ${k}`);
    assert.equal(meta.labels?.["app.kubernetes.io/name"], want.nameOverride, `${o.metadata.name}: name label`);
  }
  assert.ok(testPods(ov).length === 1, "the helm test pod gets them too");
});

test("overrides: a podLabels entry cannot replace one of the chart's labels (the selectors use them)", () => {
  assert.equal(want.podLabels["app.kubernetes.io/component"], "hijack", "the overrides set tries");
  for (const [o, meta] of pods(ov)) assert.notEqual(meta.labels?.["app.kubernetes.io/component"], "hijack", `${o.metadata.name}`);
  const { sts } = control(ov);
  for (const [k, v] of Object.entries(sts.spec.selector.matchLabels)) assert.equal(sts.spec.template.metadata.labels[k], v, `selector label ${k}`);
});

test("overrides: logLevel reaches both daemons", () => {
  assert.equal(control(ov).s["log-level"], want.logLevel, "kvfence-control log-level");
  assert.equal(node(ov).s["log-level"], want.logLevel, "kvfence-node log-level");
  for (const r of all.filter((x) => x !== ov)) {
    assert.equal(control(r).s["log-level"], "info", `${r.name}: control log-level by default`);
    assert.equal(node(r).s["log-level"], "info", `${r.name}: node log-level by default`);
  }
});

test("overrides: extraEnv per component, after the chart's own variables", () => {
  const cEnv = envOf(control(ov).c), nEnv = envOf(node(ov).c);
  for (const e of want.controlPlane.extraEnv) assert.equal(cEnv[e.name], e.value, `control: ${e.name}`);
  for (const e of want.node.extraEnv) assert.equal(nEnv[e.name], e.value, `node: ${e.name}`);
  assert.equal(cEnv.KVF_NODE_RETAIN_ROOMS, undefined, "node extraEnv stays out of the control plane");
  assert.equal(nEnv.TZ, undefined, "control extraEnv stays out of the node");
  assert.equal(node(ov).s["retain-rooms"], "2048", "the node reads an extra KVF_NODE_ setting");
});

test("overrides: nodeSelector, tolerations and affinity per component", () => {
  const c = control(ov).spec, n = node(ov).spec;
  assert.deepEqual(c.nodeSelector, want.controlPlane.nodeSelector);
  assert.deepEqual(c.tolerations, want.controlPlane.tolerations);
  assert.deepEqual(c.affinity, want.controlPlane.affinity);
  // The node's selector merges with the chart's GPU label (null drops it: ci/dev-values.yaml).
  assert.deepEqual(n.nodeSelector, { "nvidia.com/gpu.present": "true", ...want.node.nodeSelector });
  assert.deepEqual(n.tolerations, want.node.tolerations);
  assert.deepEqual(n.affinity, want.node.affinity);
});

for (const r of all) {
  test(`${r.name}: helm test pod: the CLI's health check against the control Service, with the operator's certificate under mutual TLS`, () => {
    const tp = testPods(r);
    assert.equal(tp.length, 1, "one pod with the helm.sh/hook: test annotation");
    const p = tp[0], c = p.spec.containers[0];
    const { s } = control(r);
    assert.equal(p.spec.restartPolicy, "Never");
    assert.ok([...(c.command ?? []), ...(c.args ?? [])].join(" ").includes("kvfence"), "runs the kvfence CLI");
    const env = envOf(c);
    const port = s.listen.split(":").pop();
    assert.match(env.KVFENCE_SERVER ?? "", new RegExp(`^[a-z0-9-]+-control\\.kvfence\\.svc:${port}$`), "KVFENCE_SERVER: the control Service");
    const args = (c.args ?? []).join(" ");
    assert.equal(/--tls-ca /.test(args), Boolean(s["tls-cert"]), "--tls-ca exactly when TLS is on");
    assert.equal(/--tls-cert /.test(args), Boolean(s["tls-client-ca"]), "an operator's certificate exactly with mutual TLS");
    if (s["tls-client-ca"]) {
      const vol = p.spec.volumes.find((v) => v.secret);
      assert.ok(vol, "the operator's certificate comes from a Secret");
    }
    assert.equal(p.spec.automountServiceAccountToken, false);
    assert.ok(c.resources?.limits?.cpu && c.resources?.limits?.memory, "resources");
    assert.equal(c.securityContext?.runAsNonRoot ?? p.spec.securityContext?.runAsNonRoot, true, "runs as non-root");
  });

  test(`${r.name}: NOTES: kvfence CLI commands with the TLS flags the control plane needs, no 'once the CLI ships'`, () => {
    const { s } = control(r);
    const port = s.listen.split(":").pop();
    assert.doesNotMatch(r.notes, /once the kvfence CLI ships/i);
    assert.doesNotMatch(r.notes, /kvfence --control/, "the CLI's flag is --server");
    assert.match(r.notes, new RegExp(`kvfence --server localhost:${port}`));
    assert.match(r.notes, /\$k stats/);
    assert.match(r.notes, /helm test /);
    assert.equal(/--tls-ca /.test(r.notes), Boolean(s["tls-cert"]), "--tls-ca exactly when TLS is on");
    assert.equal(/--tls-cert /.test(r.notes), Boolean(s["tls-client-ca"]), "--tls-cert exactly with mutual TLS");
  });
}
