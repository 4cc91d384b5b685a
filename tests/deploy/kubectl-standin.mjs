// A stand-in for `kubectl` while notes.test.mjs runs the chart's NOTES
// commands on this machine: there is no Kubernetes API here, so the few calls
// the notes make are answered from the rendered objects and the local cluster
// the test started, after checking that they name objects the chart renders.
// Anything else is refused (exit 64), so a new kind of command in the notes
// fails the test until it is understood here.
//
//   kubectl -n NS port-forward svc/NAME LOCAL:REMOTE
//       NAME must be a rendered Service with port REMOTE; answers as kubectl
//       does and exits (the test has pointed localhost:REMOTE at the real
//       local address instead: the forward itself is what is stood in for).
//   kubectl -n NS get secret NAME -o jsonpath='{.data.KEY}'
//       NAME must be a Secret the rendered objects name (a Certificate's, a
//       pod volume's); prints KEY base64-encoded, from the test's files.
//   kubectl get --raw /api/v1/namespaces/NS/services/NAME:PORT/proxy/PATH
//       the API server's service proxy: NAME a rendered Service with a port
//       named PORT; GET http://<its local address>/PATH.
//
// The facts come from $KVF_STANDIN (a JSON file the test writes); each call is
// appended to its "log" file.
import { readFileSync, appendFileSync, existsSync } from "node:fs";
import { join } from "node:path";

const facts = JSON.parse(readFileSync(process.env.KVF_STANDIN, "utf8"));
const argv = process.argv.slice(2);
appendFileSync(facts.log, JSON.stringify(argv) + "\n");

function refuse(msg) {
  process.stderr.write(`kubectl (stand-in): ${msg}: ${argv.join(" ")}\n`);
  process.exit(64);
}

let ns = null;
const rest = [];
for (let i = 0; i < argv.length; i++) {
  if (argv[i] === "-n" || argv[i] === "--namespace") ns = argv[++i];
  else if (argv[i].startsWith("--namespace=")) ns = argv[i].slice(12);
  else rest.push(argv[i]);
}
const service = (name) => facts.services[name] ?? refuse(`no Service ${name} is rendered`);

if (rest[0] === "port-forward") {
  if (ns !== facts.namespace) refuse(`namespace ${ns}, the release is in ${facts.namespace}`);
  const m = /^(?:svc|service)\/(.+)$/.exec(rest[1] ?? "");
  if (!m) refuse("port-forward takes svc/NAME here");
  const svc = service(m[1]);
  const ports = rest.slice(2);
  if (!ports.length) refuse("port-forward without a port");
  for (const p of ports) {
    const [local, remote = local] = p.split(":");
    if (!Object.values(svc.ports).some((x) => String(x.port) === remote)) refuse(`Service ${m[1]} has no port ${remote}`);
    process.stdout.write(`Forwarding from 127.0.0.1:${local} -> ${remote}\n`);
  }
  process.exit(0);
}

if (rest[0] === "get" && rest[1] === "secret") {
  if (ns !== facts.namespace) refuse(`namespace ${ns}, the release is in ${facts.namespace}`);
  const name = rest[2];
  const oi = rest.indexOf("-o");
  const out = oi > 0 ? rest[oi + 1] : rest.find((a) => a.startsWith("-o="))?.slice(3) ?? rest.find((a) => a.startsWith("--output="))?.slice(9);
  if (!facts.secrets.includes(name)) refuse(`no rendered object names a Secret ${name} (known: ${facts.secrets.join(", ")})`);
  const m = /^jsonpath=\{\.data\.((?:[A-Za-z0-9_-]|\\\.)+)\}$/.exec(out ?? "");
  if (!m) refuse("only -o jsonpath='{.data.KEY}' is stood in for");
  const key = m[1].replace(/\\\./g, ".");
  const file = join(facts.secretsDir, name, key);
  if (!existsSync(file)) refuse(`Secret ${name} has no key ${key}`);
  process.stdout.write(readFileSync(file).toString("base64"));
  process.exit(0);
}

if (rest[0] === "get" && rest[1] === "--raw") {
  const m = /^\/api\/v1\/namespaces\/([^/]+)\/services\/([^/:]+):([^/]+)\/proxy\/(.*)$/.exec(rest[2] ?? "");
  if (!m) refuse("only the service proxy (/api/v1/namespaces/NS/services/NAME:PORT/proxy/PATH) is stood in for");
  if (m[1] !== facts.namespace) refuse(`namespace ${m[1]}, the release is in ${facts.namespace}`);
  const port = service(m[2]).ports[m[3]] ?? refuse(`Service ${m[2]} has no port named ${m[3]}`);
  if (!port.local) refuse(`nothing runs behind ${m[2]}:${m[3]} here`);
  const res = await fetch(`http://${port.local}/${m[4]}`);
  if (!res.ok) refuse(`GET ${m[4]}: HTTP ${res.status}`);
  process.stdout.write(await res.text());
  process.exit(0);
}

refuse("not a call the notes are known to make");
