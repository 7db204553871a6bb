//! Prometheus text exposition, as the tests read it: a page's samples, one series' value by
//! name and labels or by the prefix of its line, and a scrape of a loopback `/metrics`. The
//! CLI's process suites, the broker suites and the bench read pages with it; the soak keeps
//! its two readers (heap, in-flight), which must tell an unread page from a zero.

/// One sample of the text exposition format: name, labels, value.
pub type Sample = (String, Vec<(String, String)>, f64);

/// The text of `/metrics` on loopback `port`.
pub async fn scrape(port: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Every sample of a `/metrics` text. A line that is not a sample (a page cut short, say)
/// is skipped.
pub fn samples(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let Some(name_end) = line.find(['{', ' ']) else {
            continue;
        };
        let name = line[..name_end].to_owned();
        let mut labels = Vec::new();
        let mut rest = &line[name_end..];
        if let Some(r) = rest.strip_prefix('{') {
            let mut chars = r.char_indices().peekable();
            let mut key = String::new();
            let mut end = 0;
            while let Some((i, c)) = chars.next() {
                match c {
                    '}' => {
                        end = i + 1;
                        break;
                    }
                    ',' => {}
                    '=' => {
                        chars.next(); // the opening quote
                        let mut value = String::new();
                        while let Some((_, c)) = chars.next() {
                            match c {
                                '\\' => {
                                    if let Some((_, escaped)) = chars.next() {
                                        value.push(escaped);
                                    }
                                }
                                '"' => break,
                                c => value.push(c),
                            }
                        }
                        labels.push((std::mem::take(&mut key), value));
                    }
                    c => key.push(c),
                }
            }
            rest = &r[end..];
        }
        let value = rest.trim().parse::<f64>().unwrap_or(f64::NAN);
        out.push((name, labels, value));
    }
    out
}

/// The sum of `name`'s samples that carry all of `labels`.
pub fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(text)
        .into_iter()
        .filter(|(n, ls, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// The value of the first sample in a metrics text whose line starts with `prefix` (a
/// metric name with its labels), or 0 when there is none.
pub fn metric_value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .map(|v| v.parse::<f64>().unwrap())
        .unwrap_or(0.0)
}

/// Reads `name{labels}` (summed over the series that carry `labels`) from `port`'s
/// `/metrics` (every 100 ms) until it satisfies `done` or `timeout` has passed, and returns
/// the last value read: the caller asserts on it, so a failure says what the value was.
pub async fn eventually_value(
    port: u16,
    name: &str,
    labels: &[(&str, &str)],
    timeout: std::time::Duration,
    done: impl Fn(f64) -> bool,
) -> f64 {
    crate::eventually_every(
        std::time::Duration::from_millis(100),
        timeout,
        async || value(&scrape(port).await, name, labels),
        |v| done(*v),
    )
    .await
}
