// Policy checks on the rendered objects: what the binaries are told must agree
// with the probes, Services, volumes and grace periods around them.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  renders, ofKind, one, byName, control, node, parseArgs, portOf, hostOf, resolvePort, matches, quantity,
  controlSettingNames,
} from "./lib.mjs";

const all = renders();
const known = controlSettingNames();

function podSpecs(r) {
  const out = [];
  for (const o of r.objects) {
    const spec = o.spec?.template?.spec;
    if (spec) out.push([o, spec]);
  }
  return out;
}

for (const r of all) {
  test(`${r.name}: images are pinned (a release tag or a digest, never latest)`, () => {
    for (const [o, spec] of podSpecs(r))
      for (const c of [...(spec.initContainers ?? []), ...spec.containers]) {
        const img = c.image;
        assert.ok(img, `${o.metadata.name}/${c.name}: no image`);
        if (img.includes("@sha256:")) continue;
        const tag = /:([^/:]+)$/.exec(img)?.[1];
        assert.ok(tag, `${o.metadata.name}/${c.name}: image ${img} has no tag`);
        assert.notEqual(tag, "latest", `${o.metadata.name}/${c.name}: image ${img}`);
      }
  });

  test(`${r.name}: every container has cpu and memory requests and limits, limits >= requests`, () => {
    for (const [o, spec] of podSpecs(r))
      for (const c of [...(spec.initContainers ?? []), ...spec.containers]) {
        const { requests = {}, limits = {} } = c.resources ?? {};
        for (const res of ["cpu", "memory"]) {
          assert.ok(requests[res] !== undefined, `${o.metadata.name}/${c.name}: no ${res} request`);
          assert.ok(limits[res] !== undefined, `${o.metadata.name}/${c.name}: no ${res} limit`);
          assert.ok(quantity(limits[res]) >= quantity(requests[res]), `${o.metadata.name}/${c.name}: ${res} limit < request`);
        }
      }
  });

  test(`${r.name}: control plane listens on all interfaces, with a known config`, () => {
    const { s } = control(r);
    assert.equal(hostOf(s.listen), "0.0.0.0", `listen = ${s.listen}`);
    assert.equal(hostOf(s["metrics-listen"]), "0.0.0.0", `metrics-listen = ${s["metrics-listen"]}`);
    if (known) for (const k of Object.keys(s.__file)) assert.ok(known.has(k), `config file setting '${k}' is not a kvfence-control setting`);
  });

  test(`${r.name}: control-plane probes are on grpc.health.v1 at the gRPC port (or /healthz at the metrics port with TLS)`, () => {
    const { c, s } = control(r);
    const grpcPort = portOf(s.listen), metricsPort = portOf(s["metrics-listen"]);
    const tls = Boolean(s["tls-cert"]);
    for (const kind of ["livenessProbe", "readinessProbe", "startupProbe"]) {
      const p = c[kind];
      assert.ok(p, `no ${kind}`);
      if (tls) {
        // kubelet gRPC probes are plaintext: they would fail the TLS handshake.
        assert.ok(!p.grpc, `${kind}: gRPC probe on a TLS port`);
        assert.equal(p.httpGet?.path, "/healthz", `${kind}: want httpGet /healthz`);
        assert.equal(resolvePort(c, p.httpGet.port), metricsPort, `${kind} port`);
      } else {
        assert.ok(p.grpc, `${kind}: want a gRPC (grpc.health.v1) probe`);
        assert.equal(resolvePort(c, p.grpc.port), grpcPort, `${kind} port`);
        assert.ok(!p.grpc.service, `${kind}: the server's overall health is the empty service name`);
      }
    }
    const byPortName = Object.fromEntries(c.ports.map((p) => [p.name, p.containerPort]));
    assert.equal(byPortName.grpc, grpcPort, "containerPort grpc");
    assert.equal(byPortName.metrics, metricsPort, "containerPort metrics");
  });

  test(`${r.name}: Services expose the ports kvfence-control listens on`, () => {
    const { sts, c, s } = control(r);
    const want = { grpc: portOf(s.listen), metrics: portOf(s["metrics-listen"]) };
    const podLabels = sts.spec.template.metadata.labels;
    const svcs = ofKind(r, "Service").filter((x) => matches(x.spec.selector, podLabels));
    assert.equal(svcs.length, 2, "a headless and a client Service select the control plane");
    const headless = svcs.find((x) => x.spec.clusterIP === "None");
    assert.ok(headless, "no headless Service");
    assert.equal(sts.spec.serviceName, headless.metadata.name, "StatefulSet serviceName");
    for (const svc of svcs) {
      for (const name of ["grpc", "metrics"]) {
        const p = svc.spec.ports.find((x) => x.name === name);
        assert.ok(p, `${svc.metadata.name}: no '${name}' port`);
        assert.equal(p.port, want[name], `${svc.metadata.name} ${name} port`);
        assert.equal(resolvePort(c, p.targetPort ?? p.port), want[name], `${svc.metadata.name} ${name} targetPort`);
      }
    }
  });

  test(`${r.name}: the write-ahead log lives on the StatefulSet's volume claim`, () => {
    const { sts, c, s } = control(r);
    assert.equal(sts.spec.replicas, 1, "one replica: the embedded store is a single writer");
    assert.ok(s["data-dir"], "no --data-dir: the state would be in memory only");
    const claims = (sts.spec.volumeClaimTemplates ?? []).map((v) => v.metadata.name);
    const m = (c.volumeMounts ?? []).find((x) => x.mountPath === s["data-dir"]);
    assert.ok(m, `nothing mounted at the data dir ${s["data-dir"]}`);
    assert.ok(claims.includes(m.name), `${s["data-dir"]} is mounted from '${m.name}', not a volume claim (${claims})`);
    assert.ok(!m.readOnly, "data dir mounted read-only");
  });

  test(`${r.name}: TLS files come from a Secret`, () => {
    const { spec, c, s } = control(r);
    for (const k of ["tls-cert", "tls-key", "tls-client-ca"]) {
      if (!s[k]) continue;
      const m = (c.volumeMounts ?? []).find((x) => s[k].startsWith(x.mountPath + "/"));
      const vol = m && spec.volumes.find((v) => v.name === m.name);
      assert.ok(vol?.secret, `${k} ${s[k]} is not in a Secret volume`);
      assert.ok(!vol.secret.optional, `${k}: the Secret is optional while TLS is on`);
    }
  });

  test(`${r.name}: PodDisruptionBudget, ServiceAccount, ServiceMonitor`, () => {
    const { sts, spec } = control(r);
    const podLabels = sts.spec.template.metadata.labels;
    const pdb = ofKind(r, "PodDisruptionBudget").find((p) => matches(p.spec.selector.matchLabels, podLabels));
    assert.ok(pdb, "no PodDisruptionBudget for the control plane");
    const sa = byName(r, "ServiceAccount", spec.serviceAccountName);
    assert.ok(sa, `ServiceAccount ${spec.serviceAccountName} not rendered`);
    assert.equal(node(r).spec.serviceAccountName, spec.serviceAccountName);
    for (const sm of ofKind(r, "ServiceMonitor")) {
      const svcs = ofKind(r, "Service").filter((x) => matches(sm.spec.selector.matchLabels, x.metadata.labels));
      assert.equal(svcs.length, 1, "a ServiceMonitor selects exactly one Service (no double scrape)");
      for (const ep of sm.spec.endpoints) {
        const p = svcs[0].spec.ports.find((x) => x.name === ep.port);
        assert.ok(p, `ServiceMonitor port '${ep.port}' not in ${svcs[0].metadata.name}`);
        assert.equal(p.port, portOf(control(r).s["metrics-listen"]));
      }
    }
  });

  test(`${r.name}: node DaemonSet: grace period covers preStop and the drain`, () => {
    const { spec, c, s } = node(r);
    const drainS = Number(s["drain-timeout-ms"]) / 1000;
    const pre = c.lifecycle?.preStop?.exec?.command;
    assert.ok(pre, "no preStop hook");
    const sleep = pre[0] === "sleep" ? Number(pre[1]) : 0;
    assert.ok(spec.terminationGracePeriodSeconds >= drainS + sleep + 5,
      `terminationGracePeriodSeconds ${spec.terminationGracePeriodSeconds} < preStop ${sleep} s + drain ${drainS} s + 5 s`);
    assert.ok(drainS >= 60, `drain-timeout-ms ${s["drain-timeout-ms"]} below 60000`);
  });

  test(`${r.name}: node DaemonSet: id from the node name, control address, probes`, () => {
    const { spec, c, s } = node(r);
    assert.deepEqual(s["node-id"], { fieldRef: { fieldPath: "spec.nodeName" } }, "node id must come from spec.nodeName");
    // --control names the client Service and its gRPC port.
    const ctl = control(r);
    const client = ofKind(r, "Service").find((x) => x.spec.clusterIP !== "None" && matches(x.spec.selector, ctl.sts.spec.template.metadata.labels));
    assert.ok(s.control, "no --control");
    assert.equal(hostOf(s.control).split(".")[0], client.metadata.name, `--control ${s.control}`);
    assert.equal(portOf(s.control), portOf(ctl.s.listen), `--control ${s.control}: port`);
    // Probes: grpc.health.v1 on the local socket (out of the kubelet's reach, so an exec of
    // `kvfence-node --probe` on the node's own socket) and the data port.
    const dataPort = Number(s["data-port"]);
    assert.ok(dataPort > 0, "--data-port must be fixed (peers dial it)");
    assert.equal(c.ports.find((p) => p.name === "data")?.containerPort, dataPort, "containerPort data");
    const probe = c.readinessProbe?.exec?.command ?? [];
    const probeArgs = parseArgs(probe.slice(1));
    assert.equal(probe[0], "kvfence-node", "readiness: kvfence-node --probe (grpc.health.v1)");
    assert.equal(probeArgs.probe, "true", "readiness: kvfence-node --probe");
    assert.equal(probeArgs["local-socket"], s["local-socket"], "readiness: the node's local socket");
    const probeMs = Number(probeArgs["probe-timeout-ms"] ?? 1000);
    assert.ok((c.readinessProbe.timeoutSeconds ?? 1) * 1000 > probeMs,
      `readiness: timeoutSeconds ${c.readinessProbe.timeoutSeconds} must exceed --probe-timeout-ms ${probeMs}`);
    assert.equal(resolvePort(c, c.livenessProbe?.tcpSocket?.port), dataPort, "liveness: the data port");
    // The peer channel: fixed too (peers connect to the endpoint the Hello announces), not the data port.
    const peerPort = Number(s["peer-port"]);
    assert.ok(peerPort > 0 && peerPort !== dataPort, "--peer-port must be fixed and differ from --data-port");
    assert.equal(c.ports.find((p) => p.name === "peer")?.containerPort, peerPort, "containerPort peer");
  });

  test(`${r.name}: node DaemonSet: host access of an RDMA/GPU node`, () => {
    const { spec, c, s } = node(r);
    assert.equal(spec.hostIPC, true, "hostIPC: the engines share memory with the node");
    const sockDir = s["local-socket"].replace(/\/[^/]+$/, "");
    const m = c.volumeMounts.find((x) => x.mountPath === sockDir);
    const vol = m && spec.volumes.find((v) => v.name === m.name);
    assert.equal(vol?.hostPath?.path, sockDir, `the socket dir ${sockDir} must be a hostPath shared with the engines`);
    const sc = c.securityContext ?? {};
    assert.ok(sc.privileged || sc.capabilities?.add?.includes("IPC_LOCK"), "IPC_LOCK for pinned memory");
    if (!sc.privileged) assert.equal(sc.runAsUser, 0, "added capabilities are effective only for uid 0");
    const gpuNode = (spec.tolerations ?? []).some((t) => t.key === "nvidia.com/gpu");
    if (gpuNode) {
      assert.ok(spec.nodeSelector && Object.keys(spec.nodeSelector).length, "GPU tolerations without a node selector");
      assert.equal(c.env.find((e) => e.name === "NVIDIA_VISIBLE_DEVICES")?.value, "all", "GPU visibility");
      const rdmaRes = Object.keys(c.resources.limits).some((k) => k.startsWith("rdma/"));
      const ib = c.volumeMounts.some((x) => x.mountPath === "/dev/infiniband");
      assert.ok(rdmaRes || (ib && sc.privileged), "RDMA: the device plugin resource, or /dev/infiniband with privileged");
      assert.ok(rdmaRes || spec.hostNetwork, "RDMA: host network or the device plugin");
      assert.ok(!Object.keys(c.resources.limits).includes("nvidia.com/gpu"), "the node must not take GPUs from the engines");
    }
    if (spec.hostNetwork) assert.equal(spec.dnsPolicy, "ClusterFirstWithHostNet", "host network needs ClusterFirstWithHostNet to resolve the Service");
  });

  if (r.notes !== null)
    test(`${r.name}: NOTES.txt prints grpcurl commands for the gRPC port`, () => {
      const { s } = control(r);
      const port = portOf(s.listen);
      assert.match(r.notes, new RegExp(`grpcurl .*localhost:${port} grpc\\.health\\.v1\\.Health/Check`));
      assert.match(r.notes, /kvfence\.v1\.Admin\/ListNodes/);
      assert.match(r.notes, /once the kvfence CLI ships/i);
      assert.equal(/-plaintext/.test(r.notes), !s["tls-cert"], "-plaintext exactly when TLS is off");
    });
}
