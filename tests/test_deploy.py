"""deploy/: the Kubernetes manifests against the Kubernetes API schemas (kubernetes-validate,
strict: no unknown fields), what they must say for a drain to work, and the HAProxy file as
HAProxy itself reads it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.replicas

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.33.0"


def documents() -> list[dict]:
    return [doc for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_pod_drains_before_it_is_killed():
    (deployment,) = [d for d in documents() if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    drain = float(args[args.index("--drain-timeout") + 1])
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    # preStop, then the drain, then at most 4 s of closing, all within the grace period.
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain + 4
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "redis://" in args[args.index("--voice-store") + 1]
    (hpa,) = [d for d in documents() if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "voxws_active_streams"


def test_the_pod_pulls_its_weights_serves_them_and_keeps_its_compile_cache():
    (deployment,) = [d for d in documents() if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    model = args[args.index("--model") + 1]
    pull, ahead = pod["initContainers"]
    assert pull["args"][:2] == ["models", "pull"] and pull["args"][pull["args"].index("--dir") + 1] == model
    # The step compiled ahead of time, with serve's options, into the cache the server reads.
    assert ahead["args"][0] == "compile" and ahead["resources"]["limits"]["nvidia.com/gpu"] == 1
    for option in ("--engine", "--model", "--device", "--compile-cache"):
        assert ahead["args"][ahead["args"].index(option) + 1] == args[args.index(option) + 1], option
    assert {m["name"]: m["mountPath"] for m in ahead["volumeMounts"]}["compile-cache"] == \
        {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["compile-cache"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert model.startswith(mounts["models"] + "/")
    assert args[args.index("--compile-cache") + 1].startswith(mounts["compile-cache"] + "/")
    assert {v["name"] for v in pod["volumes"]} >= {"models", "compile-cache"}
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    # The startup probe outlasts a first start's compile (20 min and more).
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 20 * 60
    claims = {d["metadata"]["name"] for d in documents() if d["kind"] == "PersistentVolumeClaim"}
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] in claims


def test_only_the_ingress_controller_may_name_a_client():
    """Hardening V, 7: the manifest trusted the whole pod network (10.244.0.0/16), so any pod of
    the cluster named any client by X-Forwarded-For. Now a NetworkPolicy admits the port only
    from the ingress controller (and Prometheus, untrusted), and the trusted range is the
    controller's own."""
    import ipaddress

    (deployment,) = [d for d in documents() if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    trusted = [ipaddress.ip_network(n) for n in env["VOX_WS_TRUSTED_PROXIES"].split(",")]
    assert all(n.prefixlen >= 24 for n in trusted), trusted            # a pool, not the pod network
    (policy,) = [d for d in documents() if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    port = container["ports"][0]["containerPort"]
    sources = set()
    for rule in policy["spec"]["ingress"]:
        assert [p["port"] for p in rule["ports"]] == [port]
        for peer in rule["from"]:            # a namespace and a pod selector both: never "any pod"
            assert peer["namespaceSelector"]["matchLabels"] and peer["podSelector"]["matchLabels"]
            sources.add(peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
    assert sources == {"ingress-nginx", "monitoring"}


def test_every_name_that_reaches_the_server_is_one_it_answers_to():
    """Hardening VI, 2: a request whose Host the server does not answer to is refused (DNS
    rebinding). The ingress reaches the pod under a public name, which the manifest names in
    VOX_WS_ALLOWED_HOSTS; the probes (the pod's IP) and Open WebUI in compose (`vox-ws`) are
    answered to without it."""
    from urllib.parse import urlsplit

    from vox_ws.transports.hosts import AllowedHosts

    (deployment,) = [d for d in documents() if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    named = {e["name"]: e.get("value") for e in container["env"]}["VOX_WS_ALLOWED_HOSTS"].split(",")
    assert named and not AllowedHosts([], own_names=()).allows(named[0])       # a public name: needed
    assert AllowedHosts(named).allows(named[0]) and "*" not in named
    default = AllowedHosts([])
    assert default.allows("10.244.3.7:8765") and default.allows("vox-ws.default.svc.cluster.local")
    webui = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["open-webui"]["environment"]
    assert default.allows(urlsplit(webui["AUDIO_TTS_OPENAI_API_BASE_URL"]).netloc)


def test_haproxy_reads_the_configuration():
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed (scripts/test.sh installs Debian's)")
    check = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


# ------------------------------------------------------------------ Docker Compose

COMPOSE_SPEC = ROOT / ".tools" / "compose" / "compose_spec.json"


def _compose_validator():
    import json

    import jsonschema

    if not COMPOSE_SPEC.is_file():
        pytest.fail("the Compose schema is fetched by scripts/test.sh (the full lane): run it")
    return jsonschema.Draft201909Validator(json.loads(COMPOSE_SPEC.read_text()))


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml"])
def test_the_compose_files_are_valid_compose(name):
    validator = _compose_validator()
    doc = yaml.safe_load((DEPLOY / name).read_text())
    assert [error.message for error in validator.iter_errors(doc)] == []
    broken = {**doc, "services": {**doc["services"], "vox-ws": {**doc["services"]["vox-ws"], "portz": [1]}}}
    assert list(validator.iter_errors(broken))                       # the schema does check


def test_compose_pairs_vox_ws_with_open_webui_and_home_assistant():
    """Open WebUI in Docker could not reach a vox-ws bound to 127.0.0.1, and no compose file
    paired them. Here the image serves on 0.0.0.0 with Wyoming on 10200, and Open WebUI is set
    up, by its own environment variables, to speak through vox-ws's OpenAI door."""
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    vox, webui = doc["services"]["vox-ws"], doc["services"]["open-webui"]
    assert vox["build"]["dockerfile"] == "deploy/Dockerfile.cpu" and "command" not in vox   # the image's own
    cmd = (DEPLOY / "Dockerfile.cpu").read_text()
    assert '"--host", "0.0.0.0"' in cmd and '"tcp://0.0.0.0:10200"' in cmd and '"dir:/data/voices"' in cmd
    assert {"127.0.0.1:8765:8765", "127.0.0.1:10200:10200"} <= {_interpolate(p, {}) for p in vox["ports"]}
    assert "voices:/data/voices" in vox["volumes"]
    assert "piper-voices:/data/piper-voices" in vox["volumes"] and "piper-voices" in doc["volumes"]
    assert "ENV VOX_WS_PIPER_VOICES_DIR=/data/piper-voices" in cmd
    env = webui["environment"]
    assert env["AUDIO_TTS_ENGINE"] == "openai" and env["AUDIO_TTS_OPENAI_API_BASE_URL"] == "http://vox-ws:8765/v1"
    assert env["AUDIO_TTS_MODEL"] and env["AUDIO_TTS_VOICE"] == "alloy"
    assert webui["depends_on"]["vox-ws"]["condition"] == "service_healthy"
    gpu = yaml.safe_load((DEPLOY / "compose.gpu.yaml").read_text())["services"]["vox-ws"]
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.cuda" and "models:/models" in gpu["volumes"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert '"dir:/data/voices"' in (DEPLOY / "Dockerfile.cuda").read_text()


def test_a_piper_voice_pulled_in_the_container_lands_in_the_folder_it_serves(tmp_path, monkeypatch):
    """`docker compose run vox-ws models pull piper:NAME` wrote into the home folder of a
    container that is thrown away, and the served folder was mounted read-only. The image names
    its voices folder once (VOX_WS_PIPER_VOICES_DIR), which `serve` serves and `models pull`
    fills without `--dir`; compose mounts it writable, as a volume of its own."""
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    (mount,) = [volume for volume in doc["services"]["vox-ws"]["volumes"] if "/data/piper-voices" in volume]
    assert mount == "piper-voices:/data/piper-voices" and "piper-voices" in doc["volumes"]     # no ":ro"
    image = (DEPLOY / "Dockerfile.cpu").read_text()
    served = re.search(r"^ENV VOX_WS_PIPER_VOICES_DIR=(\S+)$", image, re.M)[1]
    assert served == "/data/piper-voices" and '"--piper-voices-dir"' not in image    # one name for both
    assert re.search(r"mkdir -p [^\n]*/data/piper-voices", image) and "chown -R vox:vox /data" in image
    from vox_ws.commands.cli import build_parser, config_from_args
    from vox_ws.engines.piper_hub import pulled_voices_dir

    monkeypatch.setenv("VOX_WS_PIPER_VOICES_DIR", str(tmp_path / "piper-voices"))
    assert pulled_voices_dir() == tmp_path / "piper-voices"
    settings = config_from_args(build_parser().parse_args(["serve"])).engine_settings
    assert settings["piper_voices_dir"] == str(tmp_path / "piper-voices")
    # The admin route fetches voices into the folder the engine serves: the same one, the volume.
    from vox_ws.engines import create_engine

    (tmp_path / "piper-voices").mkdir()
    assert create_engine("piper", settings).voices.folder().path == str(tmp_path / "piper-voices")
    # ... given the admin token, which compose passes on (empty: none, and nothing is fetched).
    admin = doc["services"]["vox-ws"]["environment"]["VOX_WS_ADMIN_TOKEN"]
    for given, tokens in (({}, []), ({"VOX_WS_ADMIN_TOKEN": "s3cret-admin"}, ["s3cret-admin"])):
        monkeypatch.setenv("VOX_WS_ADMIN_TOKEN", _interpolate(admin, given))
        assert config_from_args(build_parser().parse_args(["serve"])).admin_tokens == tokens


_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${NAME}` and `${NAME:-default}` (the only forms these files may use), as
    `docker compose` reads them with ENV as the shell's environment."""
    result = _VARIABLE.sub(lambda m: env.get(m["name"]) or (m["default"] or ""), value)
    assert "$" not in result, f"a substitution these tests do not read: {value}"
    return result


def _published(doc: dict, env: dict[str, str]) -> dict[str, list[tuple[str, int]]]:
    """Each service's published ports as (host address, host port), after interpolation."""
    published = {}
    for name, service in doc["services"].items():
        ports = []
        for port in service.get("ports", []):
            assert isinstance(port, str), f"{name}: {port!r}: the short form with an address only"
            host, _, rest = _interpolate(port, env).rpartition(":")[0].rpartition(":")
            assert host, f"{name}: {port}: no host address, so Docker publishes it on every interface"
            ports.append((host, int(rest)))
        published[name] = ports
    return published


@pytest.mark.hardening
def test_compose_publishes_on_loopback_unless_widened_with_a_token(monkeypatch):
    """Hardening VI, 7: compose.yaml published 8765, 10200 and 3000 on every interface (Docker's
    published ports pass ufw) with no token, so the LAN or the Internet used the OpenAI door, the
    demo, Wyoming and (compose.gpu.yaml) VoxCPM2's voice cloning. Now every port is published on
    127.0.0.1 unless its variable widens it, and the token widening 8765 asks for reaches both
    vox-ws (which then requires it) and Open WebUI (which sends it)."""
    from vox_ws.commands.cli import build_parser, config_from_args

    for name in ("compose.yaml", "compose.gpu.yaml"):
        doc = yaml.safe_load((DEPLOY / name).read_text())
        for service, ports in _published(doc, {}).items():
            assert all(host == "127.0.0.1" for host, _ in ports), (name, service, ports)
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert _published(doc, {})["vox-ws"] == [("127.0.0.1", 8765), ("127.0.0.1", 10200)]
    vox_env = doc["services"]["vox-ws"]["environment"]
    webui_env = doc["services"]["open-webui"]["environment"]
    # By default: no token, and vox-ws reads the empty variable as none.
    assert _interpolate(vox_env["VOX_WS_TOKEN"], {}) == ""
    monkeypatch.setenv("VOX_WS_TOKEN", _interpolate(vox_env["VOX_WS_TOKEN"], {}))
    assert config_from_args(build_parser().parse_args(["serve"])).tokens == []
    # Widened: 8765 on every interface, and the one token both sides hold.
    widened = {"VOX_WS_PUBLISH": "0.0.0.0", "VOX_WS_TOKEN": "s3cret-token"}
    assert _published(doc, widened)["vox-ws"] == [("0.0.0.0", 8765), ("127.0.0.1", 10200)]
    assert _published(doc, widened)["open-webui"] == [("127.0.0.1", 3000)]
    monkeypatch.setenv("VOX_WS_TOKEN", _interpolate(vox_env["VOX_WS_TOKEN"], widened))
    assert config_from_args(build_parser().parse_args(["serve"])).tokens == ["s3cret-token"]
    assert _interpolate(webui_env["AUDIO_TTS_OPENAI_API_KEY"], widened) == "s3cret-token"
    assert _interpolate(webui_env["AUDIO_TTS_OPENAI_API_BASE_URL"], widened) == "http://vox-ws:8765/v1"


_PINNED_TAG = re.compile(r":v?\d+\.\d+\.\d+(?:[-.][\w.]+)?(?:@sha256:[0-9a-f]{64})?$")


@pytest.mark.hardening
def test_third_party_images_are_pinned_releases():
    """Hardening VI, 7: Open WebUI came by `:main`, a tag its project moves with every commit
    (and Kubernetes' redis by `:7`). Every image pulled from a registry names a release (a full
    version, or a digest); the images built here from deploy/Dockerfile.* are exempt."""
    pulled = []
    for path in sorted(DEPLOY.glob("compose*.yaml")):
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            if "image" in service and "build" not in service:
                pulled.append((path.name, name, service["image"]))
    for doc in documents():
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            if "/vox-ws:" not in container["image"]:                 # ours, from Dockerfile.cuda
                pulled.append((doc["metadata"]["name"], container["name"], container["image"]))
    assert ("compose.yaml", "open-webui", "ghcr.io/open-webui/open-webui:v0.12.4") in pulled
    assert [p for p in pulled if not _PINNED_TAG.search(p[2])] == []
    for moving in ("ghcr.io/open-webui/open-webui:main", "redis:7", "redis:latest", "redis"):
        assert not _PINNED_TAG.search(moving), moving                  # the check does refuse them
