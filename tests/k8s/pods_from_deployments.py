"""Reads `kubectl get deployments -o json` on stdin and prints a v1 List of Pods, one per
Deployment, each with that Deployment's pod template: what the ReplicaSet controller would
create. scripts/test-k8s.sh creates them with --dry-run=server, because Pod Security
admission enforces on Pods (on a Deployment it only warns) and no controller runs there.

    kubectl get deploy -n sluice -o json | python3 tests/k8s/pods_from_deployments.py [--break]

--break sets allowPrivilegeEscalation: true on every container: the restricted level must
refuse them.
"""

import json
import sys


def main():
    broken = "--break" in sys.argv[1:]
    deployments = json.load(sys.stdin)["items"]
    if not deployments:
        sys.exit("no Deployments read")
    pods = []
    for d in deployments:
        template = d["spec"]["template"]
        spec = json.loads(json.dumps(template["spec"]))
        if broken:
            for c in spec.get("containers", []):
                c.setdefault("securityContext", {})["allowPrivilegeEscalation"] = True
        pods.append({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": d["metadata"]["name"] + "-template-check",
                "namespace": d["metadata"]["namespace"],
                "labels": template.get("metadata", {}).get("labels", {}),
            },
            "spec": spec,
        })
    json.dump({"apiVersion": "v1", "kind": "List", "items": pods}, sys.stdout)


if __name__ == "__main__":
    main()
