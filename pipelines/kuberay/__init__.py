"""Kubernetes manifests (KubeRay RayCluster / RayJob / RayService, MLflow server) built from typed configs.

One :class:`~pipelines.kuberay.config.ClusterConfig` describes a Ray cluster; the RayCluster, RayJob
and RayService embed the cluster spec built from it, and the RayService's Serve config comes from
the serving app's ``ServingConfig``. Builders return plain dicts; the committed ``infra/k8s/`` files
are rendered from them (a test fails when they differ).

Modules: ``config``, ``manifests``, ``serve``, ``render``; nothing is re-exported here, so importing
``config`` stays light. Design notes: docs/kubernetes.md ("KubeRay manifests").
"""
