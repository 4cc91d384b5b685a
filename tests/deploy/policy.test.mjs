// Policy checks on the rendered objects: what the binaries are told must agree
// with the probes, Services, volumes and grace periods around them.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  renders, ofKind, one, byName, control, node, parseArgs, portOf, hostOf, resolvePort, matches, quantity,
  controlSettingNames, volumeAt, isInsecureSet,
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

  test(`${r.name}: control plane: gRPC on every interface or the pod IP, metrics on the pod IP, a known config`, () => {
    const { s } = control(r);
    const podIP = "{status.podIP}";
    assert.ok(["0.0.0.0", podIP].includes(hostOf(s.listen)), `listen = ${s.listen}: the Services and nodes must reach it`);
    // /metrics and /healthz are plain HTTP: not on every interface, yet reachable by the kubelet's probes and Prometheus.
    assert.equal(hostOf(s["metrics-listen"]), podIP, `metrics-listen = ${s["metrics-listen"]}`);
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
      const vol = volumeAt(spec, c, s[k]);
      assert.ok(vol?.secret, `${k} ${s[k]} is not in a Secret volume`);
      assert.ok(!vol.secret.optional, `${k}: the Secret is optional while TLS is on`);
    }
  });

  test(`${r.name}: mutual TLS unless the set is the insecure one, and then loudly`, () => {
    const { c: cc, s: cs } = control(r);
    const n = node(r);
    const insecure = isInsecureSet(r);
    const mutual = Boolean(cs["tls-cert"] && cs["tls-key"] && cs["tls-client-ca"]);
    assert.equal(mutual, !insecure, insecure ? "the insecure set runs TLS" : "mutual TLS is off (tls-cert, tls-key, tls-client-ca)");
    const podTemplates = r.objects.filter((o) => o.spec?.template?.metadata);
    if (!insecure) {
      for (const k of ["node-identity-prefix", "engine-identity-prefix", "admin-identities"])
        assert.ok(cs[k], `${k} is not set: the role mapping is implicit`);
      // The node: the control plane's CA, its own certificate and key, from a mounted volume.
      for (const k of ["control-tls-ca", "control-tls-cert", "control-tls-key"]) {
        assert.ok(n.s[k], `node: no --${k}`);
        assert.ok(volumeAt(n.spec, n.c, n.s[k]), `node: --${k} ${n.s[k]} is not on a mounted volume`);
      }
      for (const o of r.objects) assert.ok(!o.metadata.labels?.["kvfence.io/insecure"], `${o.kind} ${o.metadata.name}: insecure label on a TLS set`);
      if (r.notes !== null) assert.doesNotMatch(r.notes, /INSECURE/);
      return;
    }
    // Plaintext on purpose: every object says so, every pod carries the warning, the notes shout it.
    for (const o of r.objects) assert.equal(o.metadata.labels?.["kvfence.io/insecure"], "true", `${o.kind} ${o.metadata.name}: no kvfence.io/insecure label`);
    for (const o of podTemplates) {
      assert.equal(o.spec.template.metadata.labels?.["kvfence.io/insecure"], "true", `${o.metadata.name}: pods not labelled insecure`);
      assert.match(o.spec.template.metadata.annotations?.["kvfence.io/insecure"] ?? "", /^INSECURE/, `${o.metadata.name}: pods without the INSECURE annotation`);
    }
    for (const k of ["control-tls-ca", "control-tls-cert", "control-tls-key"]) assert.ok(!n.s[k], `node: --${k} on a plaintext control plane`);
    assert.ok(cc.readinessProbe.grpc, "plaintext: kubelet gRPC probes");
    if (r.notes !== null) assert.match(r.notes, /^\*+\nINSECURE: /m, "NOTES.txt opens with the INSECURE banner");
  });

  test(`${r.name}: cert-manager objects: a CA, the server certificate, an operator's, each named for its role`, () => {
    const { spec, c, s } = control(r);
    const certs = ofKind(r, "Certificate"), issuers = ofKind(r, "Issuer");
    if (!s["tls-cert"] || certs.length === 0) {
      assert.equal(certs.length + issuers.length, 0, "cert-manager objects without TLS");
      return;
    }
    const usable = (ref) => {
      assert.equal(ref.group ?? "cert-manager.io", "cert-manager.io");
      if (ref.kind === "ClusterIssuer") return; // the operator's own
      const iss = issuers.find((i) => i.metadata.name === ref.name);
      assert.ok(iss, `issuerRef ${ref.kind}/${ref.name} is not rendered`);
      if (iss.spec.ca) {
        const ca = certs.find((x) => x.spec.secretName === iss.spec.ca.secretName);
        assert.ok(ca?.spec.isCA, `Issuer ${ref.name}: no CA Certificate writes ${iss.spec.ca.secretName}`);
        const root = issuers.find((i) => i.metadata.name === ca.spec.issuerRef.name);
        assert.ok(root?.spec.selfSigned, `the CA ${ca.metadata.name} is not issued by a self-signed bootstrap Issuer`);
      }
    };
    // The server certificate: the Secret kvfence-control reads, naming the host the nodes dial.
    const secretName = volumeAt(spec, c, s["tls-cert"]).secret.secretName;
    const server = certs.find((x) => x.spec.secretName === secretName);
    assert.ok(server, `no Certificate writes the Secret ${secretName}`);
    assert.ok(server.spec.usages.includes("server auth"), "server certificate without server auth");
    const dialed = hostOf(node(r).s.control);
    assert.ok(server.spec.dnsNames.includes(dialed), `server certificate names ${server.spec.dnsNames}, nodes dial ${dialed}`);
    const ns = server.metadata.namespace;
    if (ns) for (const d of server.spec.dnsNames.filter((x) => x.includes(".")))
      assert.equal(d.split(".")[1], ns, `server certificate name ${d} is not in the namespace ${ns}`);
    usable(server.spec.issuerRef);
    // Clients: each names exactly one role, with client auth.
    const admins = String(s["admin-identities"]).split(",");
    const clients = certs.filter((x) => x !== server && !x.spec.isCA);
    assert.ok(clients.some((x) => x.spec.uris?.some((u) => admins.includes(u))), "no operator certificate naming an admin identity");
    for (const x of clients) {
      assert.ok(x.spec.usages.includes("client auth") && !x.spec.usages.includes("server auth"), `${x.metadata.name}: client auth only`);
      const roles = (x.spec.uris ?? []).map((u) =>
        admins.includes(u) ? "admin" : u.startsWith(s["engine-identity-prefix"]) ? "engine" : u.startsWith(s["node-identity-prefix"]) ? "node" : null);
      assert.equal(roles.filter(Boolean).length, 1, `${x.metadata.name}: names ${x.spec.uris}, want one kvfence role`);
      usable(x.spec.issuerRef);
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
    // The node name (stable across pod restarts: a new incarnation adopts its pools), or the pod name where
    // csi-driver issues the certificate (it can name the pod, not the node); the certificate must name the id.
    const idFrom = s["node-id"]?.fieldRef?.fieldPath;
    assert.ok(["spec.nodeName", "metadata.name"].includes(idFrom), `node id from ${JSON.stringify(s["node-id"])}`);
    if (s["control-tls-cert"]) {
      const prefix = control(r).s["node-identity-prefix"];
      const vol = volumeAt(spec, c, s["control-tls-cert"]);
      if (idFrom === "spec.nodeName") {
        assert.ok(vol.hostPath, "node id from the node name: its certificate is the host's (hostPath)");
        assert.equal(vol.hostPath.type, "Directory", "a missing certificate directory must stop the pod, not be created empty");
      } else {
        assert.equal(vol.csi?.driver, "csi.cert-manager.io", "node id from the pod name: its certificate from csi-driver");
        const a = vol.csi.volumeAttributes;
        assert.equal(a["csi.cert-manager.io/uri-sans"], `${prefix}\${POD_NAME}`, "the certificate must name the node id");
        assert.match(a["csi.cert-manager.io/key-usages"], /client auth/);
        const kind = a["csi.cert-manager.io/issuer-kind"] ?? "Issuer";
        if (kind === "Issuer") assert.ok(byName(r, "Issuer", a["csi.cert-manager.io/issuer-name"]), "csi-driver's Issuer is not rendered");
        if (c.securityContext?.runAsNonRoot)
          assert.equal(a["csi.cert-manager.io/fs-group"], String(c.securityContext.runAsGroup), "non-root node: the key must be readable by its group");
      }
    }
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
    // Data port and peer channel bind the data host, which is announced to peers: one address, never every interface.
    const dh = s["data-host"];
    assert.ok(dh?.fieldRef?.fieldPath === "status.podIP" || /^\d+\.\d+\.\d+\.\d+$/.test(dh), `data-host ${JSON.stringify(dh)}`);
    assert.notEqual(dh, "0.0.0.0");
  });


  test(`${r.name}: node DaemonSet: host access of an RDMA/GPU node, root only for pinned memory`, () => {
    const { spec, c, s } = node(r);
    assert.equal(spec.hostIPC, true, "hostIPC: the engines share memory with the node");
    const sockDir = s["local-socket"].replace(/\/[^/]+$/, "");
    const m = c.volumeMounts.find((x) => x.mountPath === sockDir);
    const vol = m && spec.volumes.find((v) => v.name === m.name);
    assert.equal(vol?.hostPath?.path, sockDir, `the socket dir ${sockDir} must be a hostPath shared with the engines`);
    assert.equal(spec.securityContext?.seccompProfile?.type, "RuntimeDefault", "pod seccomp profile");
    const sc = c.securityContext ?? {};
    const rdmaRes = Object.keys(c.resources.limits).some((k) => k.startsWith("rdma/"));
    const ib = c.volumeMounts.some((x) => x.mountPath === "/dev/infiniband");
    assert.equal(sc.readOnlyRootFilesystem, true, "read-only root filesystem");
    if (sc.privileged) {
      assert.ok(ib, "privileged only for /dev/infiniband from a hostPath (device cgroup)");
    } else {
      assert.equal(sc.allowPrivilegeEscalation, false, "allowPrivilegeEscalation");
      assert.ok(sc.capabilities?.drop?.includes("ALL"), "drop ALL capabilities");
      const added = sc.capabilities?.add ?? [];
      if (sc.runAsUser === 0) {
        // Root only to make IPC_LOCK effective (no ambient capabilities in Kubernetes), and only for RDMA.
        assert.deepEqual(added, ["IPC_LOCK"], "root for IPC_LOCK and nothing else");
        assert.ok(rdmaRes, "uid 0 without RDMA: nothing needs pinned memory beyond the memlock limit, run as non-root");
        assert.equal(sc.runAsNonRoot, false);
      } else {
        assert.ok(sc.runAsUser > 0 && sc.runAsNonRoot === true, `non-root node: runAsUser ${sc.runAsUser}, runAsNonRoot ${sc.runAsNonRoot}`);
        assert.deepEqual(added, [], "capabilities added to a non-root container are never effective");
        // The host's socket directory must become the node's: a root init container with CAP_CHOWN alone.
        const init = (spec.initContainers ?? []).find((x) => x.volumeMounts?.some((v) => v.name === m.name && v.mountPath === sockDir));
        assert.ok(init, "non-root node without an init container preparing the socket directory");
        assert.ok(init.command.join(" ").includes(`chown ${sc.runAsUser}:${sc.runAsGroup}`), `init: ${init.command}`);
        assert.deepEqual(init.securityContext?.capabilities?.add, ["CHOWN"], "init container: CAP_CHOWN only");
        assert.ok(init.securityContext?.capabilities?.drop?.includes("ALL"));
        assert.equal(init.securityContext?.allowPrivilegeEscalation, false);
      }
    }
    const gpuNode = (spec.tolerations ?? []).some((t) => t.key === "nvidia.com/gpu");
    if (gpuNode) {
      assert.ok(spec.nodeSelector && Object.keys(spec.nodeSelector).length, "GPU tolerations without a node selector");
      assert.equal(c.env.find((e) => e.name === "NVIDIA_VISIBLE_DEVICES")?.value, "all", "GPU visibility");
      assert.ok(rdmaRes || (ib && sc.privileged), "RDMA: the device plugin resource, or /dev/infiniband with privileged");
      assert.ok(rdmaRes || spec.hostNetwork, "RDMA: host network or the device plugin");
      assert.ok(!Object.keys(c.resources.limits).includes("nvidia.com/gpu"), "the node must not take GPUs from the engines");
    }
    if (spec.hostNetwork) assert.equal(spec.dnsPolicy, "ClusterFirstWithHostNet", "host network needs ClusterFirstWithHostNet to resolve the Service");
  });

}
