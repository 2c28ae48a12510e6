//! Running the matrix: calibration of the acceptance vector on held-out prompts, then every
//! (prompt, method, temperature) through the draft-service, appended to the results log.

use super::*;

/// A finished generation as the bench records it.
pub(super) async fn generate(
    client: &mut GenerationClient<Channel>,
    req: GenerateRequest,
) -> Result<RunRecord, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut rec = RunRecord::default();
    while let Some(chunk) = stream.message().await? {
        rec.tokens.extend(&chunk.token_ids);
        if let Some(s) = chunk.summary {
            rec.prompt_tokens = s.prompt_tokens;
            rec.generated_tokens = s.generated_tokens;
            rec.steps = s.steps;
            rec.accepted_by_rank = s.accepted_by_rank;
            rec.trials_by_rank = s.trials_by_rank;
            rec.finish_reason = s.finish_reason;
            rec.pipeline_hits = s.pipeline_hits;
            rec.pipeline_misses = s.pipeline_misses;
            rec.pipeline_wasted_ms = s.pipeline_wasted_ms;
            rec.first_tree_early = s.first_tree_early;
            rec.first_tree_with_open = s.first_tree_with_open;
            rec.trees_sent_ahead = s.trees_sent_ahead;
            rec.trees_taken_ahead = s.trees_taken_ahead;
            rec.lookup_proposed = s.lookup_proposed;
            rec.lookup_accepted = s.lookup_accepted;
            if let Some(t) = s.timings {
                rec.total_ms = t.total_ms;
                rec.prefill_ms = t.prefill_ms;
                rec.draft_ms = t.draft_ms;
                rec.verify_ms = t.verify_ms;
                rec.network_ms = t.network_ms;
            }
            if let Some(p) = s.plan {
                rec.nodes = p.nodes;
                rec.levels = p.levels;
                rec.plan_mode = p.mode;
                rec.predicted_speedup = p.predicted_speedup;
                rec.predicted_tokens_per_step = p.expected_tokens_per_step;
                rec.predicted_step_ms = p.predicted_step_ms;
            }
        }
    }
    Ok(rec)
}

pub(super) fn request(
    args: &BenchArgs,
    prompt: &Prompt,
    t: f32,
    max_tokens: u32,
    tree: Option<&Tree>,
) -> GenerateRequest {
    let mut req = GenerateRequest {
        max_tokens,
        temperature: t,
        top_p: 1.0,
        seed: Some(args.seed.wrapping_add(prompt.id)),
        tree_parents: tree.map(|t| t.parents().to_vec()).unwrap_or_default(),
        ..Default::default()
    };
    if args.raw {
        req.prompt = prompt.text.clone();
    } else {
        req.messages = vec![ChatMessage {
            role: "user".into(),
            content: prompt.text.clone(),
        }];
    }
    req
}

/// Acceptance vector for temperature `t`: given, stored from an earlier start, or measured now.
pub(super) async fn calibrate(
    args: &BenchArgs,
    client: &mut GenerationClient<Channel>,
    prompts: &[Prompt],
    t: f32,
) -> Result<Calibration> {
    if let Some(p) = &args.acceptance {
        sequoia_core::planner::validate_acceptance(p)?;
        return Ok(Calibration {
            temperature: t,
            acceptance: p.clone(),
            source: "given".into(),
            prompts: 0,
            accepted_by_rank: vec![],
            trials_by_rank: vec![],
        });
    }
    if prompts.is_empty() {
        return Ok(Calibration {
            temperature: t,
            acceptance: EXAMPLE_ACCEPTANCE[..CALIBRATION_WIDTH].to_vec(),
            source: "example".into(),
            prompts: 0,
            accepted_by_rank: vec![],
            trials_by_rank: vec![],
        });
    }
    let shape = Tree::spine(CALIBRATION_WIDTH, CALIBRATION_DEPTH);
    let mut counts = RankCounts::default();
    for p in prompts {
        let req = request(
            args,
            p,
            t,
            args.max_tokens.min(CALIBRATION_TOKENS),
            Some(&shape),
        );
        let rec = generate(client, req)
            .await
            .map_err(|s| anyhow::anyhow!("calibration generation failed: {}", s.message()))?;
        counts.add(&RankCounts::new(
            rec.accepted_by_rank.clone(),
            rec.trials_by_rank.clone(),
        ));
    }
    Ok(Calibration {
        temperature: t,
        acceptance: normalized_acceptance(counts.rates(CALIBRATION_WIDTH)),
        source: "measured".into(),
        prompts: prompts.len(),
        accepted_by_rank: counts.accepted,
        trials_by_rank: counts.trials,
    })
}

/// Errors that mean the services are gone: stop the bench instead of recording a failure.
pub(super) fn is_fatal(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

/// Run every missing (prompt, temperature, method) combination.
pub(super) async fn run_all(
    args: &BenchArgs,
    methods: &[Method],
    measured: &[Prompt],
    heldout: &[Prompt],
    draft_url: &str,
    baseline_url: &str,
    log: &mut ResultsLog,
) -> Result<()> {
    let mut spec = connect(draft_url).await?;
    let mut base = connect(baseline_url).await?;

    // Acceptance vectors for the fixed trees, one per temperature (reused on resume).
    let mut trees: BTreeMap<(String, String), Option<Tree>> = BTreeMap::new();
    for &t in &args.temperatures {
        let cal = match log.calibration(t) {
            Some(c) if args.acceptance.is_none() => c.clone(),
            _ => {
                eprintln!("== acceptance vector at T = {t}");
                let c = calibrate(args, &mut spec, heldout, t).await?;
                log.append(Record::Calibration(c.clone()))?;
                c
            }
        };
        eprintln!(
            "T = {t}: acceptance ({}) {}",
            cal.source,
            cal.acceptance
                .iter()
                .map(|p| format!("{p:.3}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for m in methods {
            let tree = m.tree(&cal.acceptance, args.max_levels)?;
            if let Some(tree) = &tree {
                eprintln!("  {m}: {} nodes, {} levels", tree.len(), tree.levels());
            }
            trees.insert((temp_key(t), m.to_string()), tree);
        }
    }

    let done = log.done();
    let total = measured.len() * args.temperatures.len() * methods.len();
    let todo: usize = measured
        .iter()
        .flat_map(|p| {
            args.temperatures.iter().flat_map(move |&t| {
                methods
                    .iter()
                    .map(move |m| (p.id, m.to_string(), temp_key(t)))
            })
        })
        .filter(|k| !done.contains(k))
        .count();
    if todo == 0 {
        eprintln!("== all {total} runs already in the results file");
        return Ok(());
    }

    // Warm-up (not recorded): connections, caches, and the auto planner's first-use profiling,
    // which would otherwise land in the first auto run's decode time.
    eprintln!("== warm-up");
    for &t in &args.temperatures {
        let p = &measured[0];
        for m in methods {
            let tree = &trees[&(temp_key(t), m.to_string())];
            let client = if m.is_baseline() {
                &mut base
            } else {
                &mut spec
            };
            let mut req = request(args, p, t, 8, tree.as_ref());
            req.pipeline = Some(m.is_pipelined());
            generate(client, req)
                .await
                .map_err(|s| anyhow::anyhow!("warm-up generation ({m}) failed: {}", s.message()))?;
        }
    }

    let bar = ProgressBar::new(total as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} runs {msg} [{elapsed_precise}, eta {eta}]",
    )?);
    bar.set_position((total - todo) as u64);
    let mut auto_fixed_warned = false;
    for (pi, prompt) in measured.iter().enumerate() {
        for &t in &args.temperatures {
            // Rotate the method order per prompt so no method always runs first.
            for j in 0..methods.len() {
                let m = &methods[(j + pi) % methods.len()];
                let key = (prompt.id, m.to_string(), temp_key(t));
                if done.contains(&key) {
                    continue;
                }
                bar.set_message(format!("{} #{} T={t} {m}", prompt.category, prompt.id));
                let tree = trees[&(temp_key(t), m.to_string())].as_ref();
                let client = if m.is_baseline() {
                    &mut base
                } else {
                    &mut spec
                };
                let mut req = request(args, prompt, t, args.max_tokens, tree);
                // Explicit either way, so a service configured with pipeline.enabled does not
                // pipeline the methods meant to run without it.
                req.pipeline = Some(m.is_pipelined());
                let mut rec = match generate(client, req).await {
                    Ok(r) => r,
                    Err(s) if is_fatal(&s) => {
                        bar.abandon();
                        bail!(
                            "{m} on prompt {} failed ({:?}): {}",
                            prompt.id,
                            s.code(),
                            s.message()
                        );
                    }
                    Err(s) => RunRecord {
                        error: Some(format!("{:?}: {}", s.code(), s.message())),
                        ..RunRecord::default()
                    },
                };
                if *m.base() == Method::Auto && rec.plan_mode == "fixed" && !auto_fixed_warned {
                    bar.println(
                        "warning: the draft-service runs tree.mode = \"fixed\"; `auto` measures \
                         its configured tree",
                    );
                    auto_fixed_warned = true;
                }
                rec.question_id = prompt.id;
                rec.category = prompt.category.clone();
                rec.method = m.to_string();
                rec.temperature = t;
                rec.pipeline = m.is_pipelined();
                if let Some(e) = &rec.error {
                    bar.println(format!("{m} on prompt {} failed: {e}", prompt.id));
                }
                log.append(Record::Run(rec))?;
                bar.inc(1);
            }
        }
    }
    bar.finish();
    Ok(())
}
