"""Reads `kubectl get -o json` output (a List, or one object) on stdin and prints a v1 List
of Pods, one per Deployment in it, each with that Deployment's pod template: what the
ReplicaSet controller would create. scripts/test-k8s.sh creates them with --dry-run=server,
because Pod Security admission enforces on Pods (on a Deployment it only warns) and no
controller runs there.

    kubectl get -f rendered.yaml -o json | python3 tests/k8s/pods_from_deployments.py [--break WAY]

--break WAY prints a single Pod (from the first Deployment), broken so that the `restricted`
level must refuse it:
  escalation  allowPrivilegeEscalation: true on every container;
  root        runAsNonRoot removed from the pod and from every container.
"""

import json
import sys

WAYS = ("escalation", "root")


def broken(spec, way):
    if way == "escalation":
        for c in spec.get("containers", []):
            c.setdefault("securityContext", {})["allowPrivilegeEscalation"] = True
    elif way == "root":
        spec.get("securityContext", {}).pop("runAsNonRoot", None)
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            c.get("securityContext", {}).pop("runAsNonRoot", None)
    return spec


def main():
    args = sys.argv[1:]
    way = None
    if args[:1] == ["--break"] and len(args) == 2 and args[1] in WAYS:
        way = args[1]
    elif args:
        sys.exit(f"usage: pods_from_deployments.py [--break {'|'.join(WAYS)}]")
    doc = json.load(sys.stdin)
    items = doc.get("items", [doc]) if doc.get("kind") == "List" else [doc]
    deployments = [o for o in items if o.get("kind") == "Deployment"]
    if not deployments:
        sys.exit("no Deployments read")
    if way:
        deployments = deployments[:1]
    pods = []
    for d in deployments:
        template = d["spec"]["template"]
        spec = json.loads(json.dumps(template["spec"]))
        if way:
            spec = broken(spec, way)
        pods.append({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": d["metadata"]["name"] + "-template-check",
                "namespace": d["metadata"].get("namespace", "default"),
                "labels": template.get("metadata", {}).get("labels", {}),
            },
            "spec": spec,
        })
    json.dump({"apiVersion": "v1", "kind": "List", "items": pods}, sys.stdout)


if __name__ == "__main__":
    main()
