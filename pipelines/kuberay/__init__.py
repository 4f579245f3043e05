"""Kubernetes manifests (KubeRay RayCluster / RayJob / RayService, MLflow server) built from typed configs.

Design choices:

- One pydantic :class:`~pipelines.kuberay.config.ClusterConfig` describes a Ray cluster (image, head,
  worker groups, autoscaling, storage and tracking endpoints). The RayCluster, the RayJob and the
  RayService all embed the cluster spec built from it, so the three cannot drift apart. The
  RayService's Serve config is derived from the serving application's own
  :class:`~components.serving.config.ServingConfig`.
- Builders return plain dicts (no Kubernetes client needed). The committed files under ``infra/k8s/``
  are rendered from them by ``star-elastic kuberay render``, and a test regenerates them and fails
  when they differ, so the YAML is never edited by hand.
- Quantities are always emitted as strings: KubeRay's CRDs declare them ``int-or-string``, so a YAML
  float such as ``0.5`` is rejected by the API server while ``"500m"`` is accepted.
- Names are checked against what the KubeRay operator enforces (DNS-1035 labels, lengths that leave
  room for the suffix it appends), so a bad name fails here instead of in the cluster.

Modules: ``config`` (the cluster models), ``manifests`` (cluster, job and MLflow builders), ``serve``
(the RayService), ``render`` (the committed defaults and YAML rendering). Nothing is re-exported here,
so importing ``config`` stays light (``serve`` brings the serving stack with it).
"""
