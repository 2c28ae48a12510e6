//! Chat templates: the model's own Jinja template, rendered with minijinja.
//!
//! Models ship their prompt format as a Jinja template (GGUF `tokenizer.chat_template`, or
//! `chat_template` in tokenizer_config.json) written for Hugging Face's `apply_chat_template`.
//! To render them the same way, the environment here mirrors that one:
//!
//! - `trim_blocks` and `lstrip_blocks` on (Hugging Face sets both);
//! - Python string/dict methods (`.strip()`, `.startswith()`, `.items()`, ...) via
//!   minijinja-contrib's pycompat callback, since templates are written against Jinja2 on Python;
//! - `raise_exception(msg)` (templates use it to reject bad conversations), `strftime_now(fmt)`
//!   (Llama 3.x date headers) and a `tojson` filter that writes what Python's `json.dumps`
//!   writes (`", "`/`": "` separators, no HTML escaping, non-ASCII kept) rather than minijinja's
//!   HTML-safe variant;
//! - variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Value};

use super::{ChatMessage, TokenizerError};

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template plus the special-token strings it may refer to.
#[derive(Clone)]
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compile `source`; errors if it is not valid (minijinja-supported) Jinja.
    pub(super) fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source)?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
        })
    }

    pub(super) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizerError::ChatTemplate(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| TokenizerError::ChatTemplate(describe(&e)))
    }
}

/// The error message plus minijinja's detail, without the multi-line source dump.
fn describe(e: &Error) -> String {
    match e.detail() {
        Some(detail) if !e.to_string().contains(detail) => format!("{e}: {detail}"),
        _ => e.to_string(),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(fmt)`: the current UTC time formatted with the common strftime directives.
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

/// Format `secs` since the Unix epoch (UTC) with `%Y %y %m %d %e %H %M %S %j %b %B %a %A %p %%`.
fn strftime(format: &str, secs: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(directive) = chars.next() else {
            out.push('%');
            break;
        };
        let month_name = MONTHS[(month - 1) as usize];
        match directive {
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'm' => out.push_str(&format!("{month:02}")),
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:>2}")),
            'H' => out.push_str(&format!("{hour:02}")),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'j' => out.push_str(&format!("{yday:03}")),
            'b' => out.push_str(&month_name[..3]),
            'B' => out.push_str(month_name),
            'a' => out.push_str(&DAYS[weekday][..3]),
            'A' => out.push_str(DAYS[weekday]),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            '%' => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other}"),
                ))
            }
        }
    }
    Ok(out)
}

/// `tojson(indent=None)` as Hugging Face defines it: Python's `json.dumps(value,
/// ensure_ascii=False, indent=indent)`, keys in their original order.
fn tojson(value: Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(i) => Some(i),
        None => indent,
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                let s = if f.is_nan() {
                    "NaN".to_string()
                } else if f.is_infinite() {
                    if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
                } else {
                    let s = f.to_string();
                    if s.contains(['.', 'e']) {
                        s
                    } else {
                        format!("{s}.0")
                    }
                };
                out.push_str(&s);
            }
        }
        ValueKind::String => out.push_str(
            &serde_json::to_string(v.as_str().unwrap_or_default())
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
        ),
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key_text = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => key.to_string(),
                };
                out.push_str(
                    &serde_json::to_string(&key_text)
                        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
                );
                out.push_str(": ");
                write_json(&v.get_item(key)?, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_json(item, indent, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a value of kind {}", v.kind()),
            ))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        ChatTemplate::new(source.to_string(), Some("<s>".into()), Some("</s>".into()))
            .map_err(|e| TokenizerError::ChatTemplate(e.to_string()))?
            .render(messages, true)
    }

    #[test]
    fn python_methods_and_special_tokens() {
        let out = render(
            "{{ bos_token }}{% for m in messages %}{{ m['content'].strip().upper() }}|{{ m.role.startswith('us') }}{% endfor %}{{ eos_token }}",
            &[ChatMessage::user("  hi  ")],
        )
        .unwrap();
        // Booleans print the Python way, as in Jinja2.
        assert_eq!(out, "<s>HI|True</s>");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let err = render(
            "{% if messages[0].role != 'system' %}{{ raise_exception('need a system message') }}{% endif %}",
            &[ChatMessage::user("x")],
        )
        .unwrap_err();
        assert!(err.to_string().contains("need a system message"), "{err}");
    }

    #[test]
    fn tojson_matches_python() {
        let out = render(
            "{{ {'a': 1, 'b': [1.5, 'x\"é'], 'c': none} | tojson }}",
            &[],
        )
        .unwrap();
        assert_eq!(out, r#"{"a": 1, "b": [1.5, "x\"é"], "c": null}"#);
        let out = render("{{ [1, {'k': true}] | tojson(indent=2) }}", &[]).unwrap();
        assert_eq!(out, "[\n  1,\n  {\n    \"k\": true\n  }\n]");
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hugging_face() {
        let out = render(
            "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}",
            &[ChatMessage::user("a"), ChatMessage::user("b")],
        )
        .unwrap();
        assert_eq!(out, "a\nb\n");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:05:09 UTC was a Friday, day 208 of a leap year.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %j %B %y %%", t).unwrap(),
            "26 Jul 2024 13:05:09 Friday 208 July 24 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert_eq!(
            strftime("%Y-%m-%d %a", 951_782_400).unwrap(),
            "2000-02-29 Tue"
        );
        assert!(strftime("%Q", 0).is_err());
    }
}
