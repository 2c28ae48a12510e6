//! Logging set-up shared by the services: `tracing` with an env filter (`RUST_LOG`, default
//! `info`) and optional JSON lines for log collectors.
//!
//! Log lines cannot be forged by input. Prompts, stop strings, model names, request ids and a
//! peer's error text reach log fields at many call sites, and a `%` field or a plain `&str`
//! message is written verbatim by the text formatter. Rather than trust every call site, the
//! writer itself ([`OneLine`]) escapes every control character inside an event, so one event is
//! always exactly one line whatever its fields hold. JSON output escapes them already; it goes
//! through the same writer anyway.

use std::io::{self, Write};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::{fmt, EnvFilter};

/// Install the global subscriber once; later calls are no-ops (tests start several services).
pub fn init_logging(json: bool) {
    use tracing_subscriber::util::SubscriberInitExt;
    // try_init also routes `log` records from dependencies through it (and its escaping).
    let _ = subscriber(json, io::stderr).try_init();
}

/// The services' subscriber writing to `writer`: the same filter, format and escaping as
/// [`init_logging`] (tests capture a service's log through it).
pub fn subscriber<W>(json: bool, writer: W) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    subscriber_with(json, writer, filter)
}

fn subscriber_with<W>(
    json: bool,
    writer: W,
    filter: EnvFilter,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let builder = fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(OneLine(writer));
    if json {
        Box::new(builder.json().finish())
    } else {
        Box::new(builder.finish())
    }
}

/// Wraps a writer so that each formatted event stays on one line: `\n`, `\r` and every other
/// control character except tab inside an event become `\n`, `\r`, `\u{1b}`… escapes; only the
/// event's final newline is kept. The formatter hands over one whole event per `write` call.
pub struct OneLine<W>(pub W);

impl<'a, W: MakeWriter<'a>> MakeWriter<'a> for OneLine<W> {
    type Writer = OneLineWriter<W::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        OneLineWriter(self.0.make_writer())
    }
}

pub struct OneLineWriter<W>(W);

impl<W: Write> Write for OneLineWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let (body, end) = match buf.strip_suffix(b"\n") {
            Some(body) => (body, &b"\n"[..]),
            None => (buf, &b""[..]),
        };
        let text = String::from_utf8_lossy(body);
        if !text.chars().any(|c| c.is_control() && c != '\t') {
            self.0.write_all(buf)?;
            return Ok(buf.len());
        }
        let mut out = String::with_capacity(buf.len() + 16);
        for c in text.chars() {
            match c {
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push('\t'),
                c if c.is_control() => out.push_str(&c.escape_unicode().to_string()),
                c => out.push(c),
            }
        }
        out.push_str(std::str::from_utf8(end).unwrap_or(""));
        // One write for the whole line, so concurrent events do not interleave mid-line.
        self.0.write_all(out.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn logged(json: bool, emit: impl FnOnce()) -> String {
        let buf = Buf::default();
        let out = buf.clone();
        let sub = subscriber_with(json, move || buf.clone(), EnvFilter::new("info"));
        tracing::subscriber::with_default(sub, emit);
        let bytes = out.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    const EVIL: &str = "x\n2026-01-01T00:00:00Z  INFO forged: admin logged in\r\u{1b}[2K";

    #[test]
    fn no_field_or_message_can_forge_a_line() {
        for json in [false, true] {
            let text = logged(json, || {
                tracing::info!(prompt = %EVIL, "display field");
                tracing::info!(prompt = EVIL, "str field");
                tracing::info!(message = EVIL, "message field");
                tracing::info!("formatted {EVIL}");
                tracing::warn!(error = ?EVIL, "debug field");
            });
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), 5, "json={json}: {text}");
            assert!(
                !lines.iter().any(|l| l.starts_with("2026-01-01")),
                "json={json}: {text}"
            );
            assert!(!text.contains('\r') && !text.contains('\u{1b}'), "{text:?}");
            // The content is kept, escaped.
            assert!(text.contains("forged: admin logged in"), "{text}");
        }
    }

    #[test]
    fn plain_lines_pass_unchanged() {
        let mut w = OneLineWriter(Vec::new());
        w.write_all(b"INFO a\tb = \"c\"\n").unwrap();
        assert_eq!(w.0, b"INFO a\tb = \"c\"\n");
    }
}
