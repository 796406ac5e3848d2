#!/bin/sh
# hawk-node: the entry point of the vllm-hawk images (examples/compose/).
#
#   hawk-node prefill MODEL [VLLM ARGS...]   vLLM + HawkConnector as kv_producer
#   hawk-node decode MODEL [VLLM ARGS...]    vLLM + HawkConnector as kv_consumer; with
#                                            HAWK_TT_PLATFORM set, on the Tenstorrent plugin
#   hawk-node proxy [HAWK PROXY ARGS...]     hawk proxy (listens on 0.0.0.0:8000 by default)
#   hawk-node router [VLLM-ROUTER ARGS...]   vLLM's router (listens on 0.0.0.0; router image)
#   hawk-node doctor ROLE                    hawk doctor --role ROLE
#   hawk-node health PORT                    exit 0 when http://127.0.0.1:PORT/health answers 200
#   hawk-node tiny-model DIR                 build the offline tiny test Llama (bf16) as DIR/tiny
#   hawk-node CMD...                         run CMD
#
# Configuration comes from the environment (an env file) and mounted files, never from
# the image or the command line:
#   HAWK_KV_CONFIG_FILE  a whole --kv-transfer-config JSON (see ../../configs/connector/);
#                        ${VAR} references in it are expanded, and HAWK_NODE_IP defaults
#                        to this container's own address when unset (set it with host
#                        networking: an empty value is an error)
#   HAWK_SHARED_SECRET   the shared secret (side channel: CurveZMQ + HMAC, host-staged
#                        transport; read by the connector itself), or
#   HAWK_SHARED_SECRET_FILE  a mounted file holding it (read by the connector itself);
#                        one of the two, not both. Required: the connector configs
#                        (config/*.json) have "auth": "curve", and start-up fails without it
#   HAWK_DOCTOR_ROLE     prefill|decode: run `hawk doctor --role ...` first, stop if not ready
#   HAWK_PORT            the vLLM server's port (default 8000)
set -eu

die() { echo "hawk-node: $*" >&2; exit 2; }

if [ -n "${HAWK_SHARED_SECRET_FILE:-}" ]; then
    [ -z "${HAWK_SHARED_SECRET:-}" ] || die "set HAWK_SHARED_SECRET or HAWK_SHARED_SECRET_FILE, not both"
    [ -r "$HAWK_SHARED_SECRET_FILE" ] || die "HAWK_SHARED_SECRET_FILE=$HAWK_SHARED_SECRET_FILE is not readable"
fi

kv_config() {  # the connector config with ${VAR}s expanded; fails on an unset variable
    [ -n "${HAWK_KV_CONFIG_FILE:-}" ] || die "set HAWK_KV_CONFIG_FILE (a --kv-transfer-config JSON file)"
    [ -r "$HAWK_KV_CONFIG_FILE" ] || die "HAWK_KV_CONFIG_FILE=$HAWK_KV_CONFIG_FILE is not readable"
    python3 - "$HAWK_KV_CONFIG_FILE" <<'PY'
import json, os, re, socket, sys
if "HAWK_NODE_IP" not in os.environ:  # set but empty (host networking, no value): an error below
    os.environ["HAWK_NODE_IP"] = socket.gethostbyname(socket.gethostname())
text = open(sys.argv[1]).read()
missing = sorted({m for m in re.findall(r"\$\{(\w+)\}", text) if not os.environ.get(m)})
if missing:
    sys.exit(f"hawk-node: {sys.argv[1]} uses unset or empty variable(s) {missing}")
cfg = json.loads(os.path.expandvars(text))
if "shared_secret" in cfg.get("kv_connector_extra_config", {}):
    sys.exit("hawk-node: put the shared secret in HAWK_SHARED_SECRET(_FILE), not in the JSON")
print(json.dumps(cfg))
PY
}

doctor_first() {
    if [ -n "${HAWK_DOCTOR_ROLE:-}" ]; then
        echo "hawk-node: hawk doctor --role $HAWK_DOCTOR_ROLE" >&2
        hawk doctor --role "$HAWK_DOCTOR_ROLE" || die "node not ready for role $HAWK_DOCTOR_ROLE (see above)"
    fi
}

serve() {  # serve ROLE MODEL [ARGS...]
    role=$1; shift
    [ $# -ge 1 ] || die "usage: hawk-node $role MODEL [VLLM ARGS...]"
    model=$1; shift
    doctor_first
    cfg=$(kv_config)
    case "$cfg" in
        *'"kv_role": "kv_producer"'*) [ "$role" = prefill ] || die "$HAWK_KV_CONFIG_FILE is a kv_producer config, not a $role one" ;;
        *'"kv_role": "kv_consumer"'*) [ "$role" = decode ] || die "$HAWK_KV_CONFIG_FILE is a kv_consumer config, not a $role one" ;;
        *) die "$HAWK_KV_CONFIG_FILE: kv_role must be kv_producer or kv_consumer" ;;
    esac
    set -- serve "$model" --host 0.0.0.0 --port "${HAWK_PORT:-8000}" --kv-transfer-config "$cfg" "$@"
    # a decode with HAWK_TT_PLATFORM runs the Tenstorrent platform (checked before vLLM starts)
    [ "$role" = decode ] && [ -n "${HAWK_TT_PLATFORM:-}" ] && set -- --tt-platform "$HAWK_TT_PLATFORM" "$@"
    echo "hawk-node: $role: python -m vllm_hawk.vllm_launcher $*" >&2
    exec python -m vllm_hawk.vllm_launcher "$@"
}

cmd=${1:-}; [ $# -gt 0 ] && shift
case "$cmd" in
    prefill|decode) serve "$cmd" "$@" ;;
    proxy) exec python -m vllm_hawk.proxy --host 0.0.0.0 "$@" ;;
    router) exec vllm-router --host 0.0.0.0 "$@" ;;
    doctor) exec hawk doctor --role "${1:?usage: hawk-node doctor prefill|decode}" ;;
    health) exec python3 -c "import sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % sys.argv[1], timeout=3)" "${1:?usage: hawk-node health PORT}" ;;
    tiny-model)
        dir=${1:?usage: hawk-node tiny-model DIR}
        exec python3 -c "
import os, sys
from vllm_hawk.bench.tiny_model import build_tiny_llama
path = build_tiny_llama(sys.argv[1], dtype='bfloat16')
link = os.path.join(sys.argv[1], 'tiny')
if os.path.islink(link) or os.path.exists(link):
    os.remove(link)
os.symlink(os.path.basename(path), link)
print('tiny model:', link, '->', path)" "$dir" ;;
    '') die "usage: hawk-node prefill|decode|proxy|router|doctor|health|tiny-model ..." ;;
    *) exec "$cmd" "$@" ;;
esac
