//! Provider descriptions: what a table or the flags may say for each provider, and which key
//! a built provider sends where.

use super::*;

/// A description read from JSON (the shape of a TOML table).
fn read(json: &str) -> Result<ProviderConfig, String> {
    serde_json::from_str::<ProviderConfig>(json).map_err(|e| e.to_string())
}

/// Sets a variable only this module's tests use.
fn set_env(key: &str, value: &str) {
    // Edition 2024 makes set_var unsafe because other threads may read the environment
    // concurrently; these names are unique to these tests.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var(key, value)
    };
}

/// A table reads the options' names into its provider's variant; unknown keys and providers
/// are refused.
#[test]
fn a_table_reads_its_providers_settings_and_refuses_unknown_keys() {
    let c = read(
        r#"{"provider": "openai-compatible", "model": "smollm2",
            "base-url": "http://127.0.0.1:8080", "no-stream-usage": true}"#,
    )
    .unwrap();
    assert_eq!(
        c,
        ProviderConfig::OpenaiCompatible {
            call: CallSettings::new("smollm2"),
            base_url: "http://127.0.0.1:8080".into(),
            api_key_env: None,
            stream_usage: false,
        }
    );
    assert_eq!(c.call().timeouts, HttpTimeouts::default());
    let e = read(r#"{"provider": "openai", "model": "m", "base_url": "http://x"}"#).unwrap_err();
    assert!(e.contains("unknown field `base_url`"), "{e}");
    let e = read(r#"{"provider": "gpt", "model": "m"}"#).unwrap_err();
    assert!(e.contains("unknown variant `gpt`"), "{e}");
    // `key-env`, the name of earlier releases, still reads.
    let c = read(r#"{"provider": "anthropic", "model": "m", "key-env": "BACKUP_KEY"}"#).unwrap();
    assert_eq!(
        c,
        ProviderConfig::Anthropic {
            call: CallSettings::new("m"),
            endpoint: Endpoint {
                base_url: None,
                api_key_env: Some("BACKUP_KEY".into()),
            },
        }
    );
}

/// A setting that belongs to other providers is refused, naming the setting (with its flag
/// and variable), the provider it was given to and the providers that take it.
#[test]
fn a_setting_of_another_provider_is_refused_naming_setting_and_provider() {
    for (provider, setting, value, says) in [
        (
            "openai",
            "region",
            r#""us-east-1""#,
            "`region` (--region) does not apply to provider openai; it is a setting of bedrock",
        ),
        (
            "anthropic",
            "num-ctx",
            "4096",
            "`num-ctx` (--num-ctx, SLUICE_NUM_CTX) does not apply to provider anthropic; it is a setting of ollama",
        ),
        (
            "ollama",
            "vertex-project",
            r#""p""#,
            "`vertex-project` (--vertex-project, SLUICE_VERTEX_PROJECT) does not apply to provider ollama",
        ),
        (
            "gemini",
            "vertex-location",
            r#""global""#,
            "does not apply to provider gemini; it is a setting of vertex and vertex-anthropic",
        ),
        (
            "mistral",
            "no-stream-usage",
            "true",
            "`no-stream-usage` (--no-stream-usage) does not apply to provider mistral",
        ),
        (
            "bedrock",
            "no-stream-usage",
            "true",
            "does not apply to provider bedrock",
        ),
    ] {
        let e = read(&format!(
            r#"{{"provider": "{provider}", "model": "m", "{setting}": {value}}}"#
        ))
        .unwrap_err();
        assert!(e.contains(says), "{provider} {setting}: {e}");
    }
    // Each is taken by its own provider.
    for (provider, setting, value) in [
        ("bedrock", "region", r#""us-east-1""#),
        ("ollama", "num-ctx", "4096"),
        ("vertex", "vertex-location", r#""global""#),
        ("openai", "no-stream-usage", "true"),
    ] {
        let json = format!(
            r#"{{"provider": "{provider}", "model": "m", "vertex-project": "p", "{setting}": {value}}}"#
        );
        let json = if provider.starts_with("vertex") {
            json
        } else {
            json.replace(r#""vertex-project": "p", "#, "")
        };
        assert!(read(&json).is_ok(), "{json}");
    }
}

/// Claude on Vertex is described by its kebab-case name, at a region or `global`.
#[test]
fn anthropic_on_vertex_reads_its_name_and_location() {
    let c = read(
        r#"{"provider": "vertex-anthropic", "model": "claude-sonnet-4-5@20250929",
            "vertex-project": "p", "vertex-location": "global"}"#,
    )
    .unwrap();
    let ProviderConfig::VertexAnthropic { site, .. } = &c else {
        panic!("{c:?}");
    };
    assert_eq!(site.location, "global");
    assert_eq!(c.build().unwrap().name(), "vertex-anthropic");
    // Without a location: Vertex's default region.
    let c = ProviderConfig::try_from(ProviderOptions {
        vertex_project: Some("p".into()),
        ..ProviderOptions::new(ProviderKind::Vertex, "gemini-2.0-flash")
    })
    .unwrap();
    let ProviderConfig::Vertex { site, .. } = c else {
        panic!("{c:?}");
    };
    assert_eq!(site.location, "us-central1");
}

/// What a provider cannot be described without is named, with where to put it.
#[test]
fn a_missing_setting_is_named() {
    let err = |kind, model: &str| {
        ProviderConfig::new(kind, model)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = err(ProviderKind::Vertex, "gemini-2.0-flash");
    assert!(
        e.contains("--vertex-project") && e.contains("vertex"),
        "{e}"
    );
    let e = err(ProviderKind::VertexAnthropic, "claude-sonnet-4-5@20250929");
    assert!(
        e.contains("--vertex-project") && e.contains("vertex-anthropic"),
        "{e}"
    );
    for kind in [ProviderKind::OpenaiCompatible, ProviderKind::Azure] {
        let e = err(kind, "m");
        assert!(e.contains("--base-url") && e.contains(kind.as_str()), "{e}");
    }
    let e = read(r#"{"provider": "openai", "model": "m", "api-key-env": "A KEY"}"#).unwrap_err();
    assert!(e.contains("is not an environment variable's name"), "{e}");
    // Bedrock's region may come from AWS_REGION, read when the provider is built.
    if std::env::var_os("AWS_REGION").is_none() {
        let e = ProviderConfig::new(ProviderKind::Bedrock, "m")
            .unwrap()
            .build()
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--region") && e.contains("AWS_REGION"), "{e}");
    }
}

/// The time limits: each given one replaces its default.
#[test]
fn time_limits_default_and_are_replaced_one_by_one() {
    let c = read(r#"{"provider": "ollama", "model": "m", "first-token-timeout-secs": 5}"#).unwrap();
    let t = c.call().timeouts;
    assert_eq!(t.first_token, Duration::from_secs(5));
    assert_eq!(
        (t.connect, t.between_chunks),
        (
            HttpTimeouts::default().connect,
            HttpTimeouts::default().between_chunks
        )
    );
}

/// Every provider with what it needs builds, at the model described; the key's absence is
/// the provider's own business (a keyless local server, or an error per request).
#[test]
fn every_provider_builds_with_what_it_needs() {
    for kind in [
        ProviderKind::Openai,
        ProviderKind::OpenaiCompatible,
        ProviderKind::Azure,
        ProviderKind::Mistral,
        ProviderKind::Anthropic,
        ProviderKind::Cohere,
        ProviderKind::Gemini,
        ProviderKind::Vertex,
        ProviderKind::VertexAnthropic,
        ProviderKind::Ollama,
        ProviderKind::Bedrock,
    ] {
        let mut o = ProviderOptions::new(kind, "m");
        o.base_url = Some("http://127.0.0.1:9".into());
        // A variable nobody sets: the build must not depend on the machine's keys.
        o.api_key_env = Some("SLUICE_TEST_CONFIG_UNSET_KEY_7Q".into());
        if matches!(kind, ProviderKind::Vertex | ProviderKind::VertexAnthropic) {
            o.vertex_project = Some("p".into());
        }
        if kind == ProviderKind::Bedrock {
            o.region = Some("us-east-1".into());
        }
        let c = ProviderConfig::try_from(o).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert_eq!(c.kind(), kind);
        let built = c.build().unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert_eq!(built.model(), "m", "{kind:?}");
    }
}

/// A test vendor: its variable is unique to one test, its host `vendor.test`.
fn vendor(var: &'static str) -> Vendor {
    Vendor {
        var,
        owns: |h| h == "api.vendor.test",
    }
}

/// The vendor's key goes to the vendor's hosts only: read for the public endpoint and an
/// https URL of the vendor's host; for another host (or the vendor's over plain http) it is
/// not read, and being set is an error naming the variable, the provider and the host (never
/// the key, a path or a query); a named variable is read for any host.
#[test]
fn a_vendors_key_is_read_only_for_the_vendors_hosts() {
    const VAR: &str = "SLUICE_TEST_VENDOR_KEY_A";
    set_env(VAR, "sk-vendor-secret");
    let v = vendor(VAR);
    let kind = ProviderKind::Openai;
    let sent = |base: Option<&str>, named: Option<&str>| {
        key(kind, &v, base, named).map(|(k, _)| k.map(|k| k.expose().to_owned()))
    };
    assert_eq!(
        sent(None, None).unwrap().as_deref(),
        Some("sk-vendor-secret")
    );
    assert_eq!(
        sent(Some("https://API.vendor.test/v1"), None)
            .unwrap()
            .as_deref(),
        Some("sk-vendor-secret")
    );
    for base in [
        "http://api.vendor.test",
        "https://proxy.example.test/v1?token=q",
        "https://api.vendor.test.evil.test",
    ] {
        let e = key(kind, &v, Some(base), None).unwrap_err();
        assert!(
            matches!(e, ConfigError::VendorKeyElsewhere { .. }),
            "{base}: {e}"
        );
        let e = e.to_string();
        assert!(
            e.contains(VAR) && e.contains("openai") && e.contains("--api-key-env"),
            "{e}"
        );
        for hidden in ["sk-vendor-secret", "/v1", "token=q"] {
            assert!(!e.contains(hidden), "{e}");
        }
    }
    const NAMED: &str = "SLUICE_TEST_VENDOR_KEY_B";
    set_env(NAMED, "sk-named");
    assert_eq!(
        sent(Some("https://proxy.example.test"), Some(NAMED))
            .unwrap()
            .as_deref(),
        Some("sk-named")
    );
}

/// A local server without a key still works: the vendor's variable unset, nothing is sent,
/// and an auth error would say how to name a key.
#[test]
fn another_host_without_the_vendors_key_gets_no_key() {
    let v = vendor("SLUICE_TEST_VENDOR_KEY_UNSET_C");
    let (k, source) = key(
        ProviderKind::Anthropic,
        &v,
        Some("http://127.0.0.1:8766"),
        None,
    )
    .unwrap();
    assert!(k.is_none());
    assert!(source.contains("--api-key-env"), "{source}");
    // A base URL that is not a URL is refused as such, before any key is looked at.
    let e = key(ProviderKind::Anthropic, &v, Some("localhost:8766"), None).unwrap_err();
    assert!(e.to_string().contains("not a valid URL"), "{e}");
}

/// The real vendors' hosts: the public endpoints each provider calls by default are its own.
#[test]
fn each_vendors_public_endpoint_is_its_own_host() {
    for (v, url) in [
        (Vendor::OPENAI, "https://api.openai.com"),
        (Vendor::AZURE, "https://my-res.openai.azure.com"),
        (Vendor::MISTRAL, "https://api.mistral.ai"),
        (Vendor::ANTHROPIC, "https://api.anthropic.com"),
        (Vendor::COHERE, "https://api.cohere.com"),
        (Vendor::GEMINI, "https://generativelanguage.googleapis.com"),
        (Vendor::VERTEX, vertex_origin("us-east5").as_str()),
        (Vendor::VERTEX, vertex_origin("global").as_str()),
        (Vendor::OLLAMA, "https://ollama.com"),
        (
            Vendor::BEDROCK,
            BedrockConfig::default_base_url("us-east-1").as_str(),
        ),
    ] {
        let host = reqwest::Url::parse(url).unwrap();
        assert!((v.owns)(host.host_str().unwrap()), "{} {url}", v.var);
        assert!(!(v.owns)("127.0.0.1"), "{}", v.var);
    }
}

/// The service wires what it is given: the first provider's model and the extra ones it
/// serves; a fallback provider that cannot be built is named by its place and model.
#[test]
fn the_service_serves_its_models_and_names_a_fallback_that_cannot_be_built() {
    let local = |model: &str, base: &str| {
        ProviderConfig::try_from(ProviderOptions {
            base_url: Some(base.into()),
            ..ProviderOptions::new(ProviderKind::Ollama, model)
        })
        .unwrap()
    };
    let mut config = ServiceConfig::new(local("main", "http://127.0.0.1:9"));
    config.extra_models = vec!["second".into(), " ".into(), " third ".into()];
    let service = config.service(&prometheus::Registry::new()).unwrap();
    assert_eq!(service.models(), ["main", "second", "third"]);
    config.fallback = vec![
        local("backup", "http://127.0.0.1:9"),
        local("broken", "localhost:11434"),
    ];
    let e = config
        .service(&prometheus::Registry::new())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with("provider 2 (broken): ") && e.contains("not a valid URL"),
        "{e}"
    );
}
