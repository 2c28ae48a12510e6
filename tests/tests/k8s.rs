//! The Kubernetes manifests (deploy/k8s) against what the services actually read.
//!
//! Each overlay is rendered the way `kubectl apply -k` would (a small kustomize: resources,
//! configMapGenerator, strategic-merge patches, image overrides; no hash suffixes), every object
//! is parsed into its typed Kubernetes struct (k8s-openapi), and each service's configuration is
//! loaded exactly as the pod would load it: the ConfigMap's TOML plus the container's SEQUOIA_*
//! variables. Then ports, probes, file paths, model names, Secrets, the HPA and the GPU request
//! are checked against that configuration.

use draft_service::config::DraftConfig;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PersistentVolumeClaim, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use verify_service::config::VerifyConfig;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

/// Strategic merge as kustomize applies it to these patches: maps merge key by key; lists of
/// named items (containers, env, ports, volumes) merge by `name`; anything else is replaced.
fn merge(base: &mut Value, patch: &Value) {
    let named = |items: &[Value]| items.iter().all(|i| i.get("name").is_some());
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                match b.get_mut(k) {
                    Some(bv) => merge(bv, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(b), Value::Array(p)) if named(b) && named(p) => {
            for item in p {
                match b.iter_mut().find(|x| x["name"] == item["name"]) {
                    Some(x) => merge(x, item),
                    None => b.push(item.clone()),
                }
            }
        }
        (b, p) => *b = p.clone(),
    }
}

/// The objects `kubectl apply -k dir` would create.
fn render(dir: &Path) -> Vec<Value> {
    let k = &yaml_docs(&dir.join("kustomization.yaml"))[0];
    assert_eq!(k["kind"], "Kustomization", "{}", dir.display());
    let known: BTreeSet<&str> = [
        "apiVersion",
        "kind",
        "resources",
        "configMapGenerator",
        "patches",
        "images",
        "labels",
    ]
    .into();
    for key in k.as_object().unwrap().keys() {
        assert!(
            known.contains(key.as_str()),
            "{}: {key} is not rendered by this test",
            dir.display()
        );
    }
    let mut objects = Vec::new();
    for r in k["resources"].as_array().into_iter().flatten() {
        let path = dir.join(r.as_str().unwrap());
        if path.is_dir() {
            objects.extend(render(&path));
        } else {
            objects.extend(yaml_docs(&path));
        }
    }
    for g in k["configMapGenerator"].as_array().into_iter().flatten() {
        let mut data = serde_json::Map::new();
        for f in g["files"].as_array().unwrap() {
            let f = f.as_str().unwrap();
            let (key, file) = f
                .split_once('=')
                .unwrap_or((f.rsplit('/').next().unwrap(), f));
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            data.insert(key.into(), text.into());
        }
        objects.push(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": g["name"]}, "data": data,
        }));
    }
    for p in k["patches"].as_array().into_iter().flatten() {
        for patch in yaml_docs(&dir.join(p["path"].as_str().expect("patch files only"))) {
            let target = objects
                .iter_mut()
                .find(|o| {
                    o["kind"] == patch["kind"] && o["metadata"]["name"] == patch["metadata"]["name"]
                })
                .unwrap_or_else(|| panic!("patch for a missing object: {}", patch["metadata"]));
            merge(target, &patch);
        }
    }
    for image in k["images"].as_array().into_iter().flatten() {
        let new = format!(
            "{}:{}",
            image["newName"].as_str().unwrap(),
            image["newTag"].as_str().unwrap()
        );
        for o in objects.iter_mut().filter(|o| o["kind"] == "Deployment") {
            let spec = &mut o["spec"]["template"]["spec"];
            for list in ["containers", "initContainers"] {
                for c in spec[list].as_array_mut().into_iter().flatten() {
                    if c["image"] == image["name"] {
                        c["image"] = new.clone().into();
                    }
                }
            }
        }
    }
    objects
}

/// One rendered overlay, typed.
#[derive(Default)]
struct Rendered {
    deployments: BTreeMap<String, Deployment>,
    services: BTreeMap<String, Service>,
    hpas: Vec<HorizontalPodAutoscaler>,
    pdbs: Vec<PodDisruptionBudget>,
    pvcs: Vec<PersistentVolumeClaim>,
    config_maps: BTreeMap<String, ConfigMap>,
}

fn typed<T: DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}: {v:#}"))
}

fn name_of(v: &Value) -> String {
    v["metadata"]["name"].as_str().unwrap().to_string()
}

fn rendered(overlay: &str) -> Rendered {
    let mut out = Rendered::default();
    for o in render(&repo().join("deploy/k8s/overlays").join(overlay)) {
        match o["kind"].as_str().unwrap() {
            "Deployment" => drop(out.deployments.insert(name_of(&o), typed(&o))),
            "Service" => drop(out.services.insert(name_of(&o), typed(&o))),
            "HorizontalPodAutoscaler" => out.hpas.push(typed(&o)),
            "PodDisruptionBudget" => out.pdbs.push(typed(&o)),
            "PersistentVolumeClaim" => out.pvcs.push(typed(&o)),
            "ConfigMap" => drop(out.config_maps.insert(name_of(&o), typed(&o))),
            other => panic!("{overlay}: unexpected kind {other}"),
        }
    }
    out
}

/// Every SEQUOIA_* variable names a real setting of `C` (figment would silently ignore a typo).
fn check_env_names<C: Serialize + Default>(c: &Container) -> BTreeMap<String, String> {
    let known = serde_json::to_value(C::default()).unwrap();
    let mut env = BTreeMap::new();
    for e in c.env.iter().flatten() {
        let Some(key) = e.name.strip_prefix("SEQUOIA_") else {
            continue;
        };
        let mut at = &known;
        for part in key.to_lowercase().split("__") {
            at = at.get(part).unwrap_or_else(|| {
                panic!(
                    "{}: {} is not a setting of {}",
                    c.name,
                    e.name,
                    std::any::type_name::<C>()
                )
            });
        }
        let value = e
            .value
            .clone()
            .unwrap_or_else(|| panic!("{}: {} needs a literal value", c.name, e.name));
        env.insert(e.name.clone(), value);
    }
    env
}

/// The configuration a container runs with: `--config FILE` (from its ConfigMap) under its
/// SEQUOIA_* variables, loaded by the services' own loader.
#[allow(clippy::result_large_err)] // figment::Jail's closure type
fn load_config<C: Serialize + DeserializeOwned + Default>(
    r: &Rendered,
    d: &Deployment,
    c: &Container,
) -> C {
    let cmd = c.command.clone().expect("explicit command");
    let at = cmd
        .iter()
        .position(|a| a == "--config")
        .expect("--config FILE");
    let file = Path::new(&cmd[at + 1]);
    let dir = file.parent().unwrap().to_str().unwrap();
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == dir)
        .expect("config mount");
    let volume = volume(d, &mount.name);
    let cm_name = &volume
        .config_map
        .as_ref()
        .expect("config from a ConfigMap")
        .name;
    let cm = &r.config_maps[cm_name];
    let key = file.file_name().unwrap().to_str().unwrap();
    let text = cm
        .data
        .as_ref()
        .unwrap()
        .get(key)
        .unwrap_or_else(|| panic!("{cm_name} has no {key}"));
    let env = check_env_names::<C>(c);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(key);
    std::fs::write(&path, text).unwrap();
    let mut out = None;
    figment::Jail::expect_with(|jail| {
        jail.clear_env();
        for (k, v) in &env {
            jail.set_env(k, v);
        }
        out = Some(
            sequoia_server::config::load(&C::default(), Some(&path), &serde_json::json!({}))
                .unwrap(),
        );
        Ok(())
    });
    out.unwrap()
}

/// The example configs (deploy/config), loaded as the services load them but inside a Jail with
/// no SEQUOIA_* variables: other tests here set a container's variables in the process
/// environment (in their own Jail, so one at a time) while these run, and the loader reads them.
#[allow(clippy::result_large_err)] // figment::Jail's closure type
fn example_configs() -> (VerifyConfig, DraftConfig) {
    let mut loaded = None;
    figment::Jail::expect_with(|jail| {
        jail.clear_env();
        let v: VerifyConfig = sequoia_server::config::load(
            &VerifyConfig::default(),
            Some(&repo().join("deploy/config/verify-service.toml")),
            &serde_json::json!({}),
        )
        .unwrap();
        let d: DraftConfig = sequoia_server::config::load(
            &DraftConfig::default(),
            Some(&repo().join("deploy/config/draft-service.toml")),
            &serde_json::json!({}),
        )
        .unwrap();
        loaded = Some((v, d));
        Ok(())
    });
    loaded.unwrap()
}

fn volume<'a>(d: &'a Deployment, name: &str) -> &'a k8s_openapi::api::core::v1::Volume {
    pod(d)
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

fn pod(d: &Deployment) -> &k8s_openapi::api::core::v1::PodSpec {
    d.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

fn container<'a>(d: &'a Deployment, name: &str) -> &'a Container {
    pod(d)
        .containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn port_of(addr: &str) -> i32 {
    addr.rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("no port in {addr:?}"))
}

fn container_port(c: &Container, name: &str) -> i32 {
    c.ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("{}: no port {name}", c.name))
        .container_port
}

/// The volume mount (and its volume) holding `path`; panics when the file would not exist.
fn mounted<'a>(
    d: &'a Deployment,
    c: &Container,
    path: &Path,
) -> &'a k8s_openapi::api::core::v1::Volume {
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| path.starts_with(&m.mount_path))
        .max_by_key(|m| m.mount_path.len())
        .unwrap_or_else(|| panic!("{}: {} is on no volume", c.name, path.display()));
    volume(d, &m.name)
}

/// One service container and the configuration it runs with.
struct ServiceCheck<'a> {
    deployment: &'a Deployment,
    container: &'a Container,
    listen: String,
    health_listen: String,
    metrics_listen: String,
    /// Files the service reads (model, TLS, tokens).
    files: Vec<PathBuf>,
    grpc_service: &'static str,
}

/// Ports, probes, files, model, Service; records the Secret keys the container reads.
fn check_service(r: &Rendered, s: &ServiceCheck<'_>, secret_keys: &mut BTreeSet<(String, String)>) {
    let c = s.container;
    assert_eq!(container_port(c, "grpc"), port_of(&s.listen), "{}", c.name);
    assert!(
        !s.health_listen.is_empty(),
        "{}: probes need health_listen",
        c.name
    );
    // The example configs bind these to loopback; a pod must open them to the pod IP, or the
    // kubelet's probes and Prometheus cannot reach them.
    for (key, addr) in [
        ("health_listen", &s.health_listen),
        ("metrics_listen", &s.metrics_listen),
    ] {
        assert!(
            addr.starts_with("0.0.0.0:"),
            "{}: {key} = {addr:?}; set SEQUOIA_{} to 0.0.0.0:PORT in the manifest",
            c.name,
            key.to_uppercase()
        );
    }
    let health = container_port(c, "health");
    assert_eq!(health, port_of(&s.health_listen), "{}", c.name);
    assert_eq!(
        container_port(c, "metrics"),
        port_of(&s.metrics_listen),
        "{}",
        c.name
    );
    let annotations = s
        .deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .clone()
        .unwrap();
    assert_eq!(
        annotations["prometheus.io/port"],
        port_of(&s.metrics_listen).to_string()
    );

    // Probes: Kubernetes' native gRPC probes (grpc.health.v1) on the plaintext health port;
    // readiness asks for the sequoia service, which turns NOT_SERVING while draining.
    for (what, probe) in [
        ("startup", &c.startup_probe),
        ("readiness", &c.readiness_probe),
        ("liveness", &c.liveness_probe),
    ] {
        let grpc = probe
            .as_ref()
            .and_then(|p| p.grpc.as_ref())
            .unwrap_or_else(|| panic!("{}: {what} probe is not gRPC", c.name));
        assert_eq!(grpc.port, health, "{}: {what} probe port", c.name);
    }
    let ready = c.readiness_probe.as_ref().unwrap().grpc.as_ref().unwrap();
    assert_eq!(ready.service.as_deref(), Some(s.grpc_service));

    for f in &s.files {
        let v = mounted(s.deployment, c, f);
        if let Some(secret) = &v.secret {
            let dir = c
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| m.name == v.name)
                .unwrap();
            let key = f.strip_prefix(&dir.mount_path).unwrap().to_str().unwrap();
            secret_keys.insert((secret.secret_name.clone().unwrap(), key.to_string()));
        }
    }

    // The model is the file the initContainer fetches, on the same volume.
    let model = &s.files[0];
    let models_volume = mounted(s.deployment, c, model);
    let init = pod(s.deployment)
        .init_containers
        .iter()
        .flatten()
        .next()
        .expect("fetch initContainer");
    let cmd = init.command.clone().unwrap();
    assert_eq!(cmd[0], "fetch-models.sh");
    let spec = sequoia_models::spec(&cmd[2]).unwrap();
    assert_eq!(
        model.file_name().unwrap().to_str().unwrap(),
        spec.file_name,
        "{}",
        c.name
    );
    let init_mount = init
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == models_volume.name)
        .expect("init mounts the model volume");
    assert_eq!(Path::new(&init_mount.mount_path), model.parent().unwrap());
    assert_eq!(cmd[1], init_mount.mount_path);
    let claim = &models_volume
        .persistent_volume_claim
        .as_ref()
        .expect("models on a PVC")
        .claim_name;
    assert!(r
        .pvcs
        .iter()
        .any(|p| p.metadata.name.as_deref() == Some(claim)));

    // A Service in front, whose ports lead to named container ports.
    let svc = &r.services[&s.deployment.metadata.name.clone().unwrap()];
    let spec = svc.spec.as_ref().unwrap();
    let pod_labels = s
        .deployment
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (k, v) in spec.selector.as_ref().unwrap() {
        assert_eq!(pod_labels.get(k), Some(v), "Service selector {k}");
    }
    for p in spec.ports.iter().flatten() {
        let IntOrString::String(target) = p.target_port.clone().unwrap() else {
            panic!("named targetPort")
        };
        assert_eq!(
            container_port(c, &target),
            p.port,
            "{} Service port {target}",
            c.name
        );
    }
}

fn given(p: &Path) -> Option<PathBuf> {
    (!p.as_os_str().is_empty()).then(|| p.to_path_buf())
}

fn check_overlay(overlay: &str, gpu: bool) {
    let r = rendered(overlay);
    // The ConfigMaps carry the example configs verbatim.
    for (cm, file) in [
        ("verify-service-config", "verify-service.toml"),
        ("draft-service-config", "draft-service.toml"),
    ] {
        let want = std::fs::read_to_string(repo().join("deploy/config").join(file)).unwrap();
        assert!(
            r.config_maps[cm].data.as_ref().unwrap()[file] == want,
            "deploy/k8s/base/config/{file} differs from deploy/config/{file}: \
             cp deploy/config/{file} deploy/k8s/base/config/"
        );
    }
    let mut secret_keys = BTreeSet::new();

    let vd = &r.deployments["verify-service"];
    let vc = container(vd, "verify-service");
    let v: VerifyConfig = load_config(&r, vd, vc);
    let mut files = vec![v.model.clone()];
    files.extend(
        [
            &v.tls_cert,
            &v.tls_key,
            &v.tls_client_ca,
            &v.auth_tokens_file,
        ]
        .into_iter()
        .filter_map(|p| given(p)),
    );
    check_service(
        &r,
        &ServiceCheck {
            deployment: vd,
            container: vc,
            listen: v.listen.clone(),
            health_listen: v.health_listen.clone(),
            metrics_listen: v.metrics_listen.clone(),
            files,
            grpc_service: sequoia_proto::v1::verifier_server::SERVICE_NAME,
        },
        &mut secret_keys,
    );
    // A drained pod ends its remaining sessions (they move) before Kubernetes kills it.
    let grace = vd
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.termination_grace_period_seconds)
        .unwrap_or(30);
    assert!(
        v.drain_timeout_secs + 5.0 < grace as f64,
        "verify drain_timeout_secs {} must leave time within terminationGracePeriodSeconds {grace}",
        v.drain_timeout_secs
    );
    assert!(
        given(&v.tls_cert).is_some() && given(&v.tls_client_ca).is_some(),
        "verify: mutual TLS on"
    );
    assert!(given(&v.auth_tokens_file).is_some(), "verify: tokens on");

    let dd = &r.deployments["draft-service"];
    let dc = container(dd, "draft-service");
    let d: DraftConfig = load_config(&r, dd, dc);
    let mut files = vec![d.model.clone()];
    files.extend(
        [
            &d.tls_cert,
            &d.tls_key,
            &d.tls_client_ca,
            &d.auth_tokens_file,
            &d.verify_tls_ca,
            &d.verify_tls_cert,
            &d.verify_tls_key,
            &d.verify_token_file,
        ]
        .into_iter()
        .filter_map(|p| given(p)),
    );
    check_service(
        &r,
        &ServiceCheck {
            deployment: dd,
            container: dc,
            listen: d.listen.clone(),
            health_listen: d.health_listen.clone(),
            metrics_listen: d.metrics_listen.clone(),
            files,
            grpc_service: sequoia_proto::v1::generation_server::SERVICE_NAME,
        },
        &mut secret_keys,
    );

    // The draft discovers verify pods through the headless Service's DNS name, and reaches them
    // over TLS with a client certificate and a token; certificates name the Service.
    let vs = r.services["verify-service"].spec.as_ref().unwrap();
    assert_eq!(
        vs.cluster_ip.as_deref(),
        Some("None"),
        "verify Service is headless"
    );
    let grpc = vs
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("grpc"))
        .unwrap();
    assert_eq!(
        d.verify,
        vec![format!("dns:///verify-service:{}", grpc.port)]
    );
    assert!(d.discovery_interval_secs > 0.0, "DNS is re-resolved");
    assert_eq!(d.verify_tls_domain, "verify-service");
    assert!(given(&d.verify_tls_cert).is_some() && given(&d.verify_token_file).is_some());
    assert!(
        given(&d.tls_cert).is_some() && given(&d.auth_tokens_file).is_some(),
        "draft: TLS and tokens on"
    );

    // The Secrets the README tells operators to create hold exactly the keys the pods read.
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    for (secret, key) in &secret_keys {
        assert!(
            readme.contains(&format!("create secret generic {secret} ")),
            "README: create {secret}"
        );
        assert!(
            readme.contains(&format!("--from-file={key}=")),
            "README: {secret} key {key}"
        );
    }
    let want: BTreeSet<(String, String)> = [
        ("sequoia-auth", "client-tokens"),
        ("sequoia-auth", "verify-token"),
        ("sequoia-tls", "ca.crt"),
        ("sequoia-tls", "draft.crt"),
        ("sequoia-tls", "draft.key"),
        ("sequoia-tls", "verify.crt"),
        ("sequoia-tls", "verify.key"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(secret_keys, want);

    // The HPA scales the verify Deployment on the batch scheduler's busy share (a Pods metric),
    // CPU as fallback,
    // and owns the replica count.
    let [hpa] = &r.hpas[..] else {
        panic!("one HPA")
    };
    let spec = hpa.spec.as_ref().unwrap();
    assert_eq!(
        (
            spec.scale_target_ref.kind.as_str(),
            spec.scale_target_ref.name.as_str()
        ),
        ("Deployment", "verify-service")
    );
    assert!(
        vd.spec.as_ref().unwrap().replicas.is_none(),
        "the HPA owns verify replicas"
    );
    let metrics = spec.metrics.as_ref().unwrap();
    assert!(metrics.iter().any(|m| m
        .pods
        .as_ref()
        .is_some_and(|p| p.metric.name == sequoia_server::metrics::BUSY_RATIO)));
    assert!(metrics
        .iter()
        .any(|m| m.resource.as_ref().is_some_and(|r| r.name == "cpu")));
    let [pdb] = &r.pdbs[..] else {
        panic!("one PodDisruptionBudget")
    };
    let selector = pdb
        .spec
        .as_ref()
        .unwrap()
        .selector
        .as_ref()
        .unwrap()
        .match_labels
        .clone()
        .unwrap();
    let labels = vd
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    assert!(
        selector.iter().all(|(k, v)| labels.get(k) == Some(v)),
        "PDB selects verify pods"
    );

    // GPU: the verify pod asks for one GPU and runs the model there; CPU: no GPU anywhere.
    let gpus = |c: &Container| {
        let res = c.resources.clone().unwrap_or_default();
        [res.requests, res.limits]
            .map(|m| m.and_then(|m| m.get("nvidia.com/gpu").map(|q| q.0.clone())))
    };
    if gpu {
        assert_eq!(gpus(vc), [Some("1".to_string()), Some("1".to_string())]);
        assert!(v.cuda, "gpu overlay sets cuda = true");
    } else {
        assert_eq!(gpus(vc), [None, None]);
        assert!(!v.cuda && !d.cuda);
    }
    assert_eq!(gpus(dc), [None, None], "the draft stays on CPU");
    for c in [vc, dc] {
        assert_eq!(
            c.image.as_deref(),
            Some(if gpu { "sequoia:gpu" } else { "sequoia:cpu" })
        );
    }
}

#[test]
fn cpu_overlay_matches_the_services() {
    check_overlay("cpu", false);
}

#[test]
fn gpu_overlay_matches_the_services() {
    check_overlay("gpu", true);
}

/// Every YAML file under deploy/k8s parses; full objects (not kustomizations or patches) parse
/// into their typed structs too.
#[test]
fn every_manifest_parses() {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&repo().join("deploy/k8s"), &mut files);
    assert!(files.len() >= 8, "{files:?}");
    for f in files {
        let is_patch = f.components().any(|c| c.as_os_str() == "overlays");
        for doc in yaml_docs(&f) {
            if doc["kind"] == "Kustomization" || is_patch {
                continue;
            }
            match doc["kind"].as_str().unwrap() {
                "Deployment" => drop(typed::<Deployment>(&doc)),
                "Service" => drop(typed::<Service>(&doc)),
                "HorizontalPodAutoscaler" => drop(typed::<HorizontalPodAutoscaler>(&doc)),
                "PodDisruptionBudget" => drop(typed::<PodDisruptionBudget>(&doc)),
                "PersistentVolumeClaim" => drop(typed::<PersistentVolumeClaim>(&doc)),
                other => panic!("{}: unexpected kind {other}", f.display()),
            }
        }
    }
}

/// The image has what the manifests run: the three binaries, the fetch script, a non-root user,
/// and the ports the configs listen on.
#[test]
fn dockerfile_matches_the_manifests() {
    let text = std::fs::read_to_string(repo().join("deploy/Dockerfile")).unwrap();
    for bin in ["verify-service", "draft-service", "sequoia"] {
        assert!(text.contains(&format!("target/release/{bin}")), "{bin}");
    }
    assert!(text.contains("COPY scripts/fetch-models.sh /usr/local/bin/fetch-models.sh"));
    assert!(text.contains("USER 10001"));
    let (v, d) = example_configs();
    let expose = text.lines().find(|l| l.starts_with("EXPOSE")).unwrap();
    for addr in [&v.listen, &v.metrics_listen, &d.listen, &d.metrics_listen] {
        assert!(expose.contains(&port_of(addr).to_string()), "EXPOSE {addr}");
    }
    let ignore = std::fs::read_to_string(repo().join(".dockerignore")).unwrap();
    assert!(ignore.lines().any(|l| l == "target"));
    assert!(
        !ignore.lines().any(|l| l.starts_with("scripts")),
        "shared embeds scripts/"
    );
}

/// Safe defaults (issue 17): outside Kubernetes, probes and metrics are reachable from this host
/// only unless configured otherwise, both in the code's defaults and in the example configs.
#[test]
fn probes_and_metrics_bind_to_loopback_unless_configured() {
    fn local_or_off(what: &str, addr: &str) {
        let host = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or("");
        assert!(
            addr.is_empty() || host == "127.0.0.1" || host == "[::1]" || host == "localhost",
            "{what} = {addr:?} is reachable from other hosts"
        );
    }
    let (v, d) = example_configs();
    let (vd, dd) = (VerifyConfig::default(), DraftConfig::default());
    for (what, addr) in [
        ("verify-service.toml health_listen", &v.health_listen),
        ("verify-service.toml metrics_listen", &v.metrics_listen),
        ("draft-service.toml health_listen", &d.health_listen),
        ("draft-service.toml metrics_listen", &d.metrics_listen),
        ("VerifyConfig::default().health_listen", &vd.health_listen),
        ("VerifyConfig::default().metrics_listen", &vd.metrics_listen),
        ("DraftConfig::default().health_listen", &dd.health_listen),
        ("DraftConfig::default().metrics_listen", &dd.metrics_listen),
    ] {
        local_or_off(what, addr);
    }
    // The example configs do turn them on (the Dockerfile and manifests rely on the ports).
    assert!(!v.metrics_listen.is_empty() && !d.health_listen.is_empty());
}
