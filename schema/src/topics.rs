//! Topic names: TrustGraph's logical `class:topicspace:topic` and the Pulsar topic URL it maps to.
//!
//! TrustGraph maps class `flow` to persistent topics and `request`/`response`/`notify` to
//! non-persistent ones. A non-persistent request topic loses every request in flight when
//! a broker restarts, and a non-persistent response topic drops records when a slow
//! consumer runs out of permits, so sluice's default ([`TopicMapping::Durable`]) makes every
//! topic persistent. TrustGraph's mapping stays selectable for wire compatibility.

use std::{fmt, str::FromStr};

/// Whether a Pulsar topic stores its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Persistence {
    /// `persistent://`: stored until acknowledged; survives broker restarts and slow consumers.
    Persistent,
    /// `non-persistent://`: forwarded in memory only; dropped on overload or restart.
    NonPersistent,
}

impl Persistence {
    /// The persistence of a Pulsar topic URL: `non-persistent://...` is non-persistent;
    /// `persistent://...`, and a name without a scheme (which Pulsar makes persistent), are
    /// persistent. The one place a topic's durability is read from its name.
    pub fn of(topic: &str) -> Self {
        if topic.starts_with("non-persistent://") {
            Persistence::NonPersistent
        } else {
            Persistence::Persistent
        }
    }

    /// Whether the broker may drop this topic's messages (on overload, on a restart): a
    /// non-persistent topic's.
    pub fn is_lossy(self) -> bool {
        self == Persistence::NonPersistent
    }

    /// The URL scheme.
    pub fn scheme(self) -> &'static str {
        match self {
            Persistence::Persistent => "persistent",
            Persistence::NonPersistent => "non-persistent",
        }
    }
}

/// How logical topic classes map to persistence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum TopicMapping {
    /// Every class is persistent: no request or response record is lost (sluice's default).
    #[default]
    Durable,
    /// TrustGraph's defaults: `flow` persistent, every other class non-persistent.
    TrustGraph,
}

impl TopicMapping {
    /// The persistence of a topic class under this mapping.
    pub fn persistence(self, class: &str) -> Persistence {
        match self {
            TopicMapping::Durable => Persistence::Persistent,
            TopicMapping::TrustGraph if class == "flow" => Persistence::Persistent,
            TopicMapping::TrustGraph => Persistence::NonPersistent,
        }
    }
}

impl FromStr for TopicMapping {
    type Err = TopicError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "durable" => Ok(TopicMapping::Durable),
            "trustgraph" => Ok(TopicMapping::TrustGraph),
            other => Err(TopicError::UnknownMapping(other.to_owned())),
        }
    }
}

/// A topic name that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    /// Not `class:topicspace:topic` and not a Pulsar topic URL.
    #[error(
        "topic {0:?} is neither `class:topicspace:topic` (e.g. request:tg:text-completion) nor a Pulsar topic URL (persistent://tenant/namespace/topic)"
    )]
    Malformed(String),
    /// Not one of the known mapping names.
    #[error("unknown topic mapping {0:?}: expected `durable` or `trustgraph`")]
    UnknownMapping(String),
}

/// A topic, named either logically (`class:topicspace:topic`) or by its Pulsar URL.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TopicName {
    /// `class:topicspace:topic`, e.g. `request:tg:text-completion:default:default`
    /// (everything after the second colon is the topic).
    Logical {
        /// The class: `flow`, `request`, `response`, `notify`...
        class: String,
        /// The topicspace, used as the Pulsar tenant.
        topicspace: String,
        /// The topic within the class.
        topic: String,
    },
    /// A full Pulsar topic URL, used as given.
    Url(String),
}

impl TopicName {
    /// The Pulsar topic URL under `mapping`:
    /// `<persistence>://<topicspace>/<class>/<topic>` for logical names.
    pub fn to_pulsar(&self, mapping: TopicMapping) -> String {
        match self {
            TopicName::Logical {
                class,
                topicspace,
                topic,
            } => format!(
                "{}://{topicspace}/{class}/{topic}",
                mapping.persistence(class).scheme()
            ),
            TopicName::Url(url) => url.clone(),
        }
    }

    /// The Pulsar `tenant/namespace` the topic lives in under any mapping.
    pub fn namespace(&self) -> Option<String> {
        match self {
            TopicName::Logical {
                class, topicspace, ..
            } => Some(format!("{topicspace}/{class}")),
            TopicName::Url(url) => {
                let rest = url.split_once("://")?.1;
                let mut parts = rest.splitn(3, '/');
                let tenant = parts.next()?;
                let namespace = parts.next()?;
                parts.next()?;
                Some(format!("{tenant}/{namespace}"))
            }
        }
    }
}

impl FromStr for TopicName {
    type Err = TopicError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let malformed = || TopicError::Malformed(s.to_owned());
        if let Some((scheme, rest)) = s.split_once("://") {
            let parts: Vec<&str> = rest.splitn(3, '/').collect();
            let valid_scheme = scheme == "persistent" || scheme == "non-persistent";
            if !valid_scheme || parts.len() != 3 || parts.iter().any(|p| p.is_empty()) {
                return Err(malformed());
            }
            return Ok(TopicName::Url(s.to_owned()));
        }
        let mut parts = s.splitn(3, ':');
        let (Some(class), Some(topicspace), Some(topic)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed());
        };
        if class.is_empty() || topicspace.is_empty() || topic.is_empty() || s.contains('/') {
            return Err(malformed());
        }
        Ok(TopicName::Logical {
            class: class.to_owned(),
            topicspace: topicspace.to_owned(),
            topic: topic.to_owned(),
        })
    }
}

impl fmt::Display for TopicName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TopicName::Logical {
                class,
                topicspace,
                topic,
            } => write!(f, "{class}:{topicspace}:{topic}"),
            TopicName::Url(url) => f.write_str(url),
        }
    }
}

/// The default logical topics of the services, in TrustGraph's `tg` topicspace: the names
/// the processors take when no topic flag is given, and their clients reach them by. One
/// place, so that a processor and its callers cannot disagree.
pub mod defaults {
    /// text-completion's requests.
    pub const TEXT_COMPLETION_REQUEST: &str = "request:tg:text-completion";
    /// text-completion's responses.
    pub const TEXT_COMPLETION_RESPONSE: &str = "response:tg:text-completion";
    /// text-completion's client cancellations.
    pub const TEXT_COMPLETION_CANCEL: &str = "notify:tg:text-completion-cancel";
    /// The prompt service's requests.
    pub const PROMPT_REQUEST: &str = "request:tg:prompt";
    /// The prompt service's responses.
    pub const PROMPT_RESPONSE: &str = "response:tg:prompt";
    /// The prompt service's client cancellations.
    pub const PROMPT_CANCEL: &str = "notify:tg:prompt-cancel";

    /// TrustGraph's topicspace, the default.
    pub const TOPICSPACE: &str = "tg";

    /// Service `service`'s topic of class `class` (`request`, `response`) in [`TOPICSPACE`].
    pub fn service_topic(class: &str, service: &str) -> String {
        topic_in(class, TOPICSPACE, service)
    }

    /// Service `service`'s cancel topic in [`TOPICSPACE`].
    pub fn cancel_topic(service: &str) -> String {
        cancel_topic_in(TOPICSPACE, service)
    }

    /// Service `service`'s topic of class `class` in `topicspace`.
    pub fn topic_in(class: &str, topicspace: &str, service: &str) -> String {
        format!("{class}:{topicspace}:{service}")
    }

    /// Service `service`'s cancel topic in `topicspace`.
    pub fn cancel_topic_in(topicspace: &str, service: &str) -> String {
        format!("notify:{topicspace}:{service}-cancel")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topics_persistence_is_read_from_its_scheme() {
        assert_eq!(
            Persistence::of("non-persistent://tg/request/x"),
            Persistence::NonPersistent
        );
        assert!(Persistence::of("non-persistent://tg/request/x").is_lossy());
        for durable in ["persistent://tg/request/x", "my-topic", "non-persistent:/x"] {
            assert_eq!(
                Persistence::of(durable),
                Persistence::Persistent,
                "{durable}"
            );
        }
    }

    #[test]
    fn the_named_defaults_are_the_services_topics() {
        use defaults::*;
        for (service, [request, response, cancel]) in [
            (
                "text-completion",
                [
                    TEXT_COMPLETION_REQUEST,
                    TEXT_COMPLETION_RESPONSE,
                    TEXT_COMPLETION_CANCEL,
                ],
            ),
            ("prompt", [PROMPT_REQUEST, PROMPT_RESPONSE, PROMPT_CANCEL]),
        ] {
            assert_eq!(request, service_topic("request", service));
            assert_eq!(response, service_topic("response", service));
            assert_eq!(cancel, cancel_topic(service));
            for t in [request, response, cancel] {
                assert!(t.parse::<TopicName>().is_ok(), "{t}");
            }
        }
    }

    #[test]
    fn trustgraph_example_maps_as_trustgraph_does() {
        let t: TopicName = "request:tg:text-completion:default:default"
            .parse()
            .unwrap();
        assert_eq!(
            t.to_pulsar(TopicMapping::TrustGraph),
            "non-persistent://tg/request/text-completion:default:default"
        );
        let f: TopicName = "flow:tg:document-load".parse().unwrap();
        assert_eq!(
            f.to_pulsar(TopicMapping::TrustGraph),
            "persistent://tg/flow/document-load"
        );
    }

    #[test]
    fn durable_mapping_makes_requests_and_responses_persistent() {
        for name in ["request:tg:x", "response:tg:x", "notify:tg:x", "flow:tg:x"] {
            let t: TopicName = name.parse().unwrap();
            assert!(
                t.to_pulsar(TopicMapping::Durable)
                    .starts_with("persistent://")
            );
        }
        assert_eq!(TopicMapping::default(), TopicMapping::Durable);
    }

    #[test]
    fn urls_pass_through_and_name_their_namespace() {
        let t: TopicName = "persistent://public/default/abc".parse().unwrap();
        assert_eq!(
            t.to_pulsar(TopicMapping::TrustGraph),
            "persistent://public/default/abc"
        );
        assert_eq!(t.namespace().as_deref(), Some("public/default"));
        let l: TopicName = "response:tg:llm".parse().unwrap();
        assert_eq!(l.namespace().as_deref(), Some("tg/response"));
        assert_eq!(l.to_string(), "response:tg:llm");
    }

    #[test]
    fn malformed_names_are_clear_errors() {
        for bad in [
            "",
            "request",
            "request:tg",
            "request::x",
            "http://a/b/c",
            "persistent://a/b",
            "a/b:c:d",
        ] {
            let err = bad.parse::<TopicName>().unwrap_err();
            assert!(err.to_string().contains("class:topicspace:topic"), "{bad}");
        }
        assert!("sideways".parse::<TopicMapping>().is_err());
    }
}
