// The commands the chart's NOTES print, and its `helm test` pod, run for real
// for every rendered option set (and two variants no set takes): against a
// kvfence-control and a kvfence-node this test starts on loopback, configured
// from the rendered objects, with the built kvfence CLI.
//
// What is real: the daemons and the CLI (the binaries of this build), the
// control plane's settings (the rendered control.conf), the node's flags (the
// rendered DaemonSet's), the TLS identities (a CA made here with openssl signs
// a server certificate with the rendered Certificate's DNS names, the
// operator's certificate naming the first admin identity, the node's naming
// <node-identity-prefix>n1), the command lines (the notes' indented lines,
// run in order by bash with -e and pipefail; the test pod's command, args and
// environment).
// What is stood in for, because there is no cluster here:
// - the Service's DNS name: the notes' `localhost:<port>` (what port-forward
//   serves) and the pod's `KVFENCE_SERVER=<service>:<port>` are pointed at the
//   local addresses; TLS still checks the Service's name (the notes pass
//   --tls-server-name, the node gets --control-tls-server-name);
// - kubectl: kubectl-standin.mjs answers port-forward, `get secret` and the
//   API server's service proxy from the rendered objects and the local
//   cluster, and refuses anything else;
// - the pod's mounts: its Secret volumes are directories of the same files.
import { test } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, existsSync, rmSync, symlinkSync } from "node:fs";
import { join, dirname } from "node:path";
import { tmpdir } from "node:os";
import { spawn, spawnSync, execFileSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { parseAllDocuments } from "yaml";
import { renders, ofKind, control, node, envOf, volumeAt, hostOf, portOf, BUILD, ROOT } from "./lib.mjs";

const CONTROL_BIN = join(BUILD, "controlplane/kvfence-control");
const NODE_BIN = join(BUILD, "dataplane/kvfence-node");
const CLI_BIN = join(BUILD, "clients/cli/kvfence");
const STANDIN = join(dirname(fileURLToPath(import.meta.url)), "kubectl-standin.mjs");
for (const b of [CONTROL_BIN, NODE_BIN, CLI_BIN]) if (!existsSync(b)) throw new Error(`${b} is not built`);

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function waitFile(path, proc, what, ms = 10000) {
  for (let t = 0; t < ms; t += 50) {
    if (existsSync(path) && readFileSync(path, "utf8").trim()) return readFileSync(path, "utf8").trim();
    if (proc.exitCode !== null) throw new Error(`${what} exited (${proc.exitCode}): ${proc.logText()}`);
    await sleep(50);
  }
  throw new Error(`${what}: nothing in ${path} after ${ms} ms: ${proc.logText()}`);
}
function start(bin, args, env, log) {
  const p = spawn(bin, args, { env: { ...process.env, ...env }, stdio: ["ignore", "pipe", "pipe"] });
  let text = "";
  p.stdout.on("data", (d) => (text += d));
  p.stderr.on("data", (d) => (text += d));
  p.logText = () => text.slice(-3000);
  p.on("exit", () => writeFileSync(log, text));
  return p;
}
async function stop(p) {
  if (!p || p.exitCode !== null) return;
  const done = new Promise((r) => p.once("exit", r));
  p.kill("SIGTERM");
  const t = setTimeout(() => p.kill("SIGKILL"), 5000);
  await done;
  clearTimeout(t);
}

// ---- the PKI
function openssl(dir, ...args) {
  execFileSync("/usr/bin/openssl", args, { cwd: dir, stdio: ["ignore", "pipe", "pipe"] });
}
function makeCa(dir) {
  openssl(dir, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
    "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=kvfence notes test CA",
    "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign");
}
// A leaf signed by the CA in dir; written as a Secret's files: <out>/{tls.crt,tls.key,ca.crt}.
function makeLeaf(dir, name, ext, out) {
  openssl(dir, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
    "-keyout", `${name}.key`, "-out", `${name}.csr`, "-subj", `/CN=kvfence notes test ${name}`);
  writeFileSync(join(dir, `${name}.ext`), `basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n${ext}\n`);
  openssl(dir, "x509", "-req", "-in", `${name}.csr`, "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
    "-out", `${name}.crt`, "-days", "2", "-sha256", "-extfile", `${name}.ext`);
  mkdirSync(out, { recursive: true });
  writeFileSync(join(out, "tls.crt"), readFileSync(join(dir, `${name}.crt`)));
  writeFileSync(join(out, "tls.key"), readFileSync(join(dir, `${name}.key`)));
  writeFileSync(join(out, "ca.crt"), readFileSync(join(dir, "ca.crt")));
}

// A path a container sees, on this machine: through its volume mounts, each
// volume a local directory (Secrets under secretsDir, with `items` projected).
function localPath(r, spec, c, path, dirs) {
  const m = (c.volumeMounts ?? []).find((x) => path === x.mountPath || path.startsWith(x.mountPath + "/"));
  if (!m) throw new Error(`${r.name}: ${c.name}: ${path} is on no volume`);
  const rel = path.slice(m.mountPath.length).replace(/^\//, "");
  const vol = spec.volumes.find((v) => v.name === m.name);
  let dir;
  if (vol.secret) {
    dir = join(dirs.secrets, vol.secret.secretName);
    if (vol.secret.items) {
      const proj = join(dirs.root, `projected-${c.name}-${vol.name}`);
      mkdirSync(proj, { recursive: true });
      for (const it of vol.secret.items) writeFileSync(join(proj, it.path), readFileSync(join(dir, it.key)));
      dir = proj;
    }
  } else if (vol.hostPath || vol.csi) dir = dirs.nodeTls; // the node's certificate (a host's files or csi-driver's)
  else throw new Error(`${r.name}: ${c.name}: volume ${vol.name} for ${path} is not stood in for`);
  return rel ? join(dir, rel) : dir;
}

// The notes' commands: every line indented by exactly two spaces.
const notesCommands = (notes) => notes.split("\n").filter((l) => /^ {2}\S/.test(l)).map((l) => l.slice(2));

// Besides the option sets run.sh rendered, the branches of NOTES.txt and of the
// test pod that no option set takes (the policy tests keep metrics on the pod
// IP, and plaintext is the only insecure set): rendered here.
const HELM = process.env.KVF_HELM;
const CHART = join(ROOT, "deploy/helm/kvfence");
function renderVariant(name, sets) {
  const args = ["kvfence", CHART, "--namespace", "kvfence", ...sets.flatMap((x) => ["--set", x])];
  const yamlText = execFileSync(HELM, ["template", ...args], { encoding: "utf8" });
  const out = execFileSync(HELM, ["install", ...args, "--dry-run=client"], { encoding: "utf8" });
  const objects = parseAllDocuments(yamlText).map((d) => d.toJS()).filter((o) => o && typeof o === "object");
  return { name, objects, notes: out.slice(out.indexOf("NOTES:")) };
}
const variants = [
  renderVariant("variant-metrics-on-every-interface", ["controlPlane.metricsHost=0.0.0.0"]),
  renderVariant("variant-server-tls-only", ["tls.mutual=false", "tls.insecure=true"]),
];

for (const r of [...renders().filter((x) => x.name.startsWith("helm-")), ...variants]) {
  test(`${r.name}: the NOTES commands and the helm test pod run against a local kvfence-control and kvfence-node`, async () => {
    const root = mkdtempSync(join(tmpdir(), `kvf-notes-${r.name}-`));
    const dirs = { root, secrets: join(root, "secrets"), nodeTls: join(root, "node-tls"), pki: join(root, "pki") };
    for (const d of Object.values(dirs)) mkdirSync(d, { recursive: true });
    let cp = null, np = null;
    const t0 = Date.now();
    const phase = (what) => process.env.KVF_NOTES_TIMES && console.log(`${r.name}: ${what} at ${Date.now() - t0} ms`);
    try {
      const { spec, c, s } = control(r);
      const ns = "kvfence";
      const tls = Boolean(s["tls-cert"]), mutual = Boolean(s["tls-client-ca"]);
      const svcs = ofKind(r, "Service");
      const client = svcs.find((x) => x.metadata.labels?.["kvfence.io/service"] === "client");
      const svcHost = `${client.metadata.name}.${ns}.svc`;

      // Certificates, as the rendered Certificates (or your Secrets) would hold them.
      const secrets = new Set();
      let adminSecret = null;
      if (tls) {
        makeCa(dirs.pki);
        const serverSecret = volumeAt(spec, c, s["tls-cert"]).secret.secretName;
        const serverCert = ofKind(r, "Certificate").find((x) => x.spec.secretName === serverSecret);
        const dns = serverCert?.spec.dnsNames ?? [client.metadata.name, `${client.metadata.name}.${ns}`, svcHost, `${svcHost}.cluster.local`];
        makeLeaf(dirs.pki, "server", `extendedKeyUsage=serverAuth\nsubjectAltName=${dns.map((d) => `DNS:${d}`).join(",")}`,
          join(dirs.secrets, serverSecret));
        secrets.add(serverSecret);
        if (mutual) {
          const admin = String(s["admin-identities"]).split(",")[0];
          const adminCert = ofKind(r, "Certificate").find((x) => x.spec.uris?.includes(admin));
          const testPod = ofKind(r, "Pod").find((p) => p.metadata.annotations?.["helm.sh/hook"] === "test");
          adminSecret = adminCert?.spec.secretName ?? testPod?.spec.volumes.find((v) => v.secret)?.secret.secretName;
          assert.ok(adminSecret, "no Secret holds the operator's certificate");
          makeLeaf(dirs.pki, "admin", `extendedKeyUsage=clientAuth\nsubjectAltName=URI:${admin}`, join(dirs.secrets, adminSecret));
          secrets.add(adminSecret);
          makeLeaf(dirs.pki, "node", `extendedKeyUsage=clientAuth\nsubjectAltName=URI:${s["node-identity-prefix"]}n1`, dirs.nodeTls);
        } else {
          writeFileSync(join(dirs.nodeTls, "ca.crt"), readFileSync(join(dirs.pki, "ca.crt")));
        }
      }

      phase("pki");
      // kvfence-control with the rendered control.conf, its paths on this machine.
      const cm = ofKind(r, "ConfigMap").find((x) => x.data?.["control.conf"]);
      const conf = cm.data["control.conf"].split("\n").map((line) => {
        const m = /^\s*([a-z0-9-]+)\s*=\s*(.*)$/.exec(line);
        if (!m) return line;
        if (m[1] === "data-dir") return `data-dir = ${join(root, "data")}`;
        if (/^tls-/.test(m[1])) return `${m[1]} = ${localPath(r, spec, c, m[2].trim(), dirs)}`;
        return line;
      }).join("\n");
      writeFileSync(join(root, "control.conf"), conf);
      cp = start(CONTROL_BIN, ["--config", join(root, "control.conf"), "--listen", "127.0.0.1:0", "--port-file", join(root, "port"),
        "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", join(root, "metrics-port")], {}, join(root, "control.log"));
      const grpcLocal = `127.0.0.1:${await waitFile(join(root, "port"), cp, "kvfence-control")}`;
      const metricsLocal = `127.0.0.1:${readFileSync(join(root, "metrics-port"), "utf8").trim()}`;

      phase("control up");
      // kvfence-node n1 with the rendered DaemonSet's flags.
      const n = node(r);
      const nodeArgs = [];
      for (const a of n.c.args) {
        const m = /^--([a-z0-9-]+)=(.*)$/.exec(a);
        assert.ok(m, `node arg ${a}: --name=value expected`);
        const [, k, v] = m;
        if (k === "control") {
          assert.equal(v, `${svcHost}:${portOf(s.listen)}`, "the nodes dial the client Service at the gRPC port");
          nodeArgs.push(`--control=${grpcLocal}`);
          if (tls) nodeArgs.push(`--control-tls-server-name=${hostOf(v)}`);
        } else if (k === "local-socket") nodeArgs.push(`--local-socket=${join(root, "node.sock")}`);
        else if (k === "data-port" || k === "peer-port") nodeArgs.push(`--${k}=0`);
        else if (/^control-tls-/.test(k)) nodeArgs.push(`--${k}=${localPath(r, n.spec, n.c, v, dirs)}`);
        else nodeArgs.push(a);
      }
      const nodeEnv = { KVF_NODE_NODE_ID: "n1", KVF_NODE_DATA_HOST: "127.0.0.1", KVF_NODE_RDMA: "off" };
      for (const [k, v] of Object.entries(envOf(n.c))) if (typeof v === "string" && k.startsWith("KVF_NODE_") && !(k in nodeEnv)) nodeEnv[k] = v;
      np = start(NODE_BIN, [...nodeArgs, "--run-dir", root], nodeEnv, join(root, "node.log"));
      // Attached, as the control plane's own /metrics says (not the CLI's output,
      // whose JSON form is the CLI's to change).
      let attached = false;
      for (let t = 0; t < 15000 && !attached; t += 200) {
        const text = await fetch(`http://${metricsLocal}/metrics`).then((x) => x.text(), () => "");
        attached = /^kvfence_nodes\{state="ATTACHED"\} 1$/m.test(text);
        if (!attached) {
          if (np.exitCode !== null) throw new Error(`kvfence-node exited ${np.exitCode}: ${np.logText()}`);
          await sleep(200);
        }
      }
      assert.ok(attached, `node n1 did not attach: ${np.logText()}`);

      phase("node attached");
      // ---- the NOTES commands
      const bin = join(root, "bin");
      mkdirSync(bin);
      symlinkSync(CLI_BIN, join(bin, "kvfence"));
      writeFileSync(join(bin, "kubectl"), `#!/bin/sh\nexec "${process.execPath}" "${STANDIN}" "$@"\n`, { mode: 0o755 });
      const services = {};
      for (const x of svcs) {
        services[x.metadata.name] = { ports: {} };
        for (const p of x.spec.ports)
          services[x.metadata.name].ports[p.name] = { port: p.port, local: p.name === "grpc" ? grpcLocal : p.name === "metrics" ? metricsLocal : null };
      }
      const log = join(root, "kubectl.log");
      writeFileSync(join(root, "standin.json"), JSON.stringify({ namespace: ns, services, secrets: [...secrets], secretsDir: dirs.secrets, log }));
      const cmds = notesCommands(r.notes);
      assert.ok(cmds.length >= 5, `only ${cmds.length} commands in the notes`);
      const grpcPort = portOf(s.listen), metricsPort = client.spec.ports.find((p) => p.name === "metrics").port;
      const script = ["set -euo pipefail", ...cmds.map((l) => l
        .replace(new RegExp(`\\blocalhost:${grpcPort}\\b`, "g"), grpcLocal)
        .replace(new RegExp(`\\blocalhost:${metricsPort}\\b`, "g"), metricsLocal))].join("\n");
      const op = join(root, "operator");
      mkdirSync(op);
      writeFileSync(join(root, "notes.sh"), script + "\n");
      const run = spawnSync("bash", [join(root, "notes.sh")], {
        cwd: op, encoding: "utf8", timeout: 60000,
        env: { ...process.env, PATH: `${bin}:${process.env.PATH}`, KVF_STANDIN: join(root, "standin.json"), KVFENCE_SERVER: "" },
      });
      assert.equal(run.status, 0, `the notes' commands failed (exit ${run.status}):\n${script}\n--- output\n${run.stdout}\n${run.stderr}`);
      assert.match(run.stdout, /^uptime_ms\s+\d+/m, "kvfence stats printed the control plane's stats");
      assert.match(run.stdout, /^n1\s+\d+\s+ATTACHED/m, "kvfence nodes listed the attached node");
      assert.match(run.stdout, /^kvfence_\w+/m, "the metrics came back");
      const calls = readFileSync(log, "utf8").trim().split("\n").map((l) => JSON.parse(l));
      assert.ok(calls.some((a) => a.includes("port-forward")), "the notes forward the gRPC port");
      if (hostOf(s["metrics-listen"]) !== "{status.podIP}")
        assert.ok(calls.some((a) => a.includes("port-forward") && a.some((x) => x.endsWith(`:${metricsPort}`))), "metrics: a port-forward of the metrics port");
      if (mutual) for (const f of ["ca.crt", "admin.crt", "admin.key"]) assert.ok(existsSync(join(op, f)), `the notes wrote ${f}`);

      phase("notes ran");
      // ---- the helm test pod
      const pods = ofKind(r, "Pod").filter((p) => p.metadata.annotations?.["helm.sh/hook"] === "test");
      assert.equal(pods.length, 1, "one helm test pod");
      const pod = pods[0], pc = pod.spec.containers[0];
      const penv = {};
      for (const [k, v] of Object.entries(envOf(pc))) {
        assert.equal(typeof v, "string", `test pod env ${k}: a plain value`);
        penv[k] = v;
      }
      assert.equal(penv.KVFENCE_SERVER, `${svcHost}:${grpcPort}`, "the test pod asks the client Service");
      penv.KVFENCE_SERVER = grpcLocal;
      const pargs = (pc.args ?? []).map((a) => (a.startsWith("/") ? localPath(r, pod.spec, pc, a, dirs) : a));
      const [exe, ...cargs] = [...pc.command, ...pargs];
      const health = () => spawnSync(exe, cargs, { encoding: "utf8", timeout: 30000, env: { ...process.env, ...penv, PATH: `${bin}:${process.env.PATH}` } });
      const ok = health();
      assert.equal(ok.status, 0, `the helm test pod's command failed (exit ${ok.status}): ${[exe, ...cargs].join(" ")}\n${ok.stdout}\n${ok.stderr}`);
      assert.ok(ok.stdout.trim().length > 0, "the health check printed something");
      phase("pod ran");
      // And it fails when the control plane is gone (exit 3: unreachable).
      await stop(np);
      await stop(cp);
      const down = health();
      phase("stopped, pod ran again");
      assert.equal(down.status, 3, `with the control plane stopped the test pod must fail with 3 (unreachable): ${down.status} ${down.stderr}`);
    } finally {
      await stop(np);
      await stop(cp);
      if (!process.env.KVF_KEEP_NOTES_TMP) rmSync(root, { recursive: true, force: true });
    }
  });
}
