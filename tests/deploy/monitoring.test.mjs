// The chart's monitoring objects (deploy/monitoring/): the PrometheusRule
// carries exactly the rules of deploy/monitoring/kvfence-rules.yaml (through
// the chart's copy, files/kvfence-rules.yaml), the PodMonitor selects the node
// DaemonSet's pods on the port the values name, and neither is rendered unless
// asked for.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { parse } from "yaml";
import { renders, ofKind, one, ROOT } from "./lib.mjs";

const all = renders();
const helm = all.filter((r) => r.name.startsWith("helm-"));
const source = parse(readFileSync(join(ROOT, "deploy/monitoring/kvfence-rules.yaml"), "utf8"));
const chartValues = parse(readFileSync(join(ROOT, "deploy/helm/kvfence/ci/monitoring-values.yaml"), "utf8"));

test("the chart's rule file is a byte-for-byte copy of deploy/monitoring/kvfence-rules.yaml", () => {
  const a = readFileSync(join(ROOT, "deploy/monitoring/kvfence-rules.yaml"), "utf8");
  const b = readFileSync(join(ROOT, "deploy/helm/kvfence/files/kvfence-rules.yaml"), "utf8");
  assert.equal(b, a, "copy deploy/monitoring/kvfence-rules.yaml to deploy/helm/kvfence/files/");
});

test("helm-monitoring: the PrometheusRule holds every rule of the source file, unchanged", () => {
  const r = all.find((x) => x.name === "helm-monitoring");
  assert.ok(r, "ci/monitoring-values.yaml was not rendered");
  const pr = one(r, "PrometheusRule");
  assert.deepEqual(pr.spec.groups, source.groups);
  assert.equal(pr.metadata.labels.release, "prometheus", "prometheusRule.labels reach the object");
  // Prometheus templates survive helm: the chart does not evaluate them.
  assert.match(JSON.stringify(pr.spec), /\{\{ \$value \}\}/);
});

test("helm-monitoring: the PodMonitor scrapes the node pods on nodeMonitor.port", () => {
  const r = all.find((x) => x.name === "helm-monitoring");
  const pm = one(r, "PodMonitor");
  const ds = ofKind(r, "DaemonSet").find((d) => d.metadata.name.endsWith("-node"));
  assert.ok(ds, "no node DaemonSet");
  const podLabels = ds.spec.template.metadata.labels;
  for (const [k, v] of Object.entries(pm.spec.selector.matchLabels))
    assert.equal(podLabels[k], v, `PodMonitor selector ${k}=${v} does not match the node pods`);
  assert.equal(pm.spec.podMetricsEndpoints.length, 1);
  const ep = pm.spec.podMetricsEndpoints[0];
  assert.equal(ep.portNumber, chartValues.nodeMonitor.port);
  assert.equal(ep.path, "/metrics");
  assert.equal(ep.interval, chartValues.nodeMonitor.interval);
  // The node serves /metrics on that port of the pod's address.
  const node = ds.spec.template.spec.containers.find((c) => c.name === "node");
  assert.ok(node.args.includes(`--metrics-listen=$(KVFENCE_POD_IP):${ep.portNumber}`),
            `the node is not told to serve /metrics on ${ep.portNumber}: ${node.args.join(" ")}`);
  const ip = node.env.find((e) => e.name === "KVFENCE_POD_IP");
  assert.equal(ip?.valueFrom?.fieldRef?.fieldPath, "status.podIP");
  // No other object of the chart selects the node pods for scraping.
  for (const sm of ofKind(r, "ServiceMonitor"))
    assert.notEqual(sm.spec.selector.matchLabels["app.kubernetes.io/component"], "node");
});

test("no PrometheusRule or PodMonitor unless enabled", () => {
  for (const r of helm.filter((x) => x.name !== "helm-monitoring")) {
    assert.equal(ofKind(r, "PrometheusRule").length, 0, `${r.name}: PrometheusRule`);
    assert.equal(ofKind(r, "PodMonitor").length, 0, `${r.name}: PodMonitor`);
  }
});
