"""Turns the PodMonitors stored in the cluster into a Prometheus configuration with Kubernetes
service discovery, doing for the Kubernetes test (scripts/test-k8s-run.sh) what the
Prometheus Operator does with them: one scrape job per podMetricsEndpoint, pods selected by
the PodMonitor's matchLabels in its namespace, the endpoint's named container port, path and
interval, and `job` taken from the pod label named by `jobLabel`.

    kubectl get podmonitors -A -o json | python3 tests/k8s/podmonitor_scrape.py \
        --api-server https://10.244.0.1:6443 --ca-file ca.crt --token-file token \
        --rules alerts.yml > prometheus.yml

Only what sluice's PodMonitor uses is translated (matchLabels, port, path, interval,
jobLabel); any other field of a PodMonitor or endpoint is refused, so that a change to the
shipped object cannot pass untranslated. Standard library only: the output is JSON, which
is YAML.
"""

import argparse
import json
import re
import sys

KNOWN_SPEC = {"jobLabel", "selector", "podMetricsEndpoints", "namespaceSelector"}
KNOWN_ENDPOINT = {"port", "path", "interval"}


def label_name(label):
    """The meta label Kubernetes SD gives a pod label."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def jobs(monitor, sd):
    meta = monitor["metadata"]
    spec = monitor["spec"]
    unknown = set(spec) - KNOWN_SPEC
    if unknown:
        sys.exit(f"PodMonitor {meta['name']}: fields not translated: {sorted(unknown)}")
    selector = spec.get("selector", {})
    if set(selector) - {"matchLabels"}:
        sys.exit(f"PodMonitor {meta['name']}: only selector.matchLabels is translated")
    namespaces = [meta["namespace"]]
    if spec.get("namespaceSelector"):
        sys.exit(f"PodMonitor {meta['name']}: namespaceSelector is not translated")
    out = []
    for i, endpoint in enumerate(spec["podMetricsEndpoints"]):
        unknown = set(endpoint) - KNOWN_ENDPOINT
        if unknown:
            sys.exit(f"PodMonitor {meta['name']}: endpoint fields not translated: {sorted(unknown)}")
        relabel = [{"source_labels": [label_name(k)], "regex": re.escape(v), "action": "keep"}
                   for k, v in selector.get("matchLabels", {}).items()]
        relabel += [
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"],
             "regex": re.escape(endpoint["port"]), "action": "keep"},
            # Running pods only, as the Operator does (a pod that finished has no target).
            {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)",
             "action": "drop"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        ]
        if spec.get("jobLabel"):
            relabel.append({"source_labels": [label_name(spec["jobLabel"])], "target_label": "job"})
        job = {
            "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{i}",
            "metrics_path": endpoint.get("path", "/metrics"),
            "kubernetes_sd_configs": [sd | {"role": "pod", "namespaces": {"names": namespaces}}],
            "relabel_configs": relabel,
        }
        if endpoint.get("interval"):
            job["scrape_interval"] = endpoint["interval"]
        out.append(job)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api-server", required=True)
    parser.add_argument("--ca-file", required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--rules", action="append", default=[])
    args = parser.parse_args()
    monitors = json.load(sys.stdin)["items"]
    if not monitors:
        sys.exit("no PodMonitor in the cluster")
    sd = {"api_server": args.api_server,
          "tls_config": {"ca_file": args.ca_file},
          "authorization": {"credentials_file": args.token_file}}
    config = {"global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
              "rule_files": args.rules,
              "scrape_configs": [j for m in monitors for j in jobs(m, sd)]}
    json.dump(config, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
