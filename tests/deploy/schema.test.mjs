// Every rendered object against the Kubernetes API schema (kubernetes-models'
// validators, generated from the OpenAPI spec; ServiceMonitor from the
// Prometheus operator's CRD, Issuer and Certificate from cert-manager's), with
// the apiVersion/kind it claims.
import { test } from "node:test";
import assert from "node:assert/strict";
import { renders } from "./lib.mjs";

async function modelOf(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : [null, apiVersion];
  const crds = { "monitoring.coreos.com": "prometheus-operator", "cert-manager.io": "cert-manager" };
  const spec = crds[group]
    ? `@kubernetes-models/${crds[group]}/${group}/${version}/${kind}`
    : `kubernetes-models/${group ? group + "/" : ""}${version}/${kind}`;
  try {
    return (await import(spec))[kind];
  } catch (e) {
    throw new Error(`no schema for ${apiVersion} ${kind} (${e.code ?? e.message})`);
  }
}

const all = renders();
test("every render set is there", () => {
  const names = all.map((r) => r.name);
  for (const want of ["helm-default", "helm-insecure", "kustomize-dev", "kustomize-insecure-dev", "kustomize-production"]) assert.ok(names.includes(want), `${want} missing from ${names}`);
  assert.ok(names.filter((n) => n.startsWith("helm-")).length >= 4, "helm default plus the option sets in ci/");
});

for (const r of all) {
  test(`${r.name}: every object is valid against the Kubernetes API schema`, async () => {
    assert.ok(r.objects.length >= 7, `only ${r.objects.length} objects`);
    const seen = new Set();
    for (const o of r.objects) {
      assert.ok(o.apiVersion && o.kind && o.metadata?.name, `object without apiVersion/kind/name: ${JSON.stringify(o).slice(0, 200)}`);
      const key = `${o.kind}/${o.metadata.namespace ?? ""}/${o.metadata.name}`;
      assert.ok(!seen.has(key), `duplicate ${key}`);
      seen.add(key);
      const Model = await modelOf(o.apiVersion, o.kind);
      try {
        new Model(o).validate();
      } catch (e) {
        assert.fail(`${o.kind} ${o.metadata.name}: ${e.message}`);
      }
    }
  });
}
