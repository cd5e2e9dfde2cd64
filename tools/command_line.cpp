// The torpor CLI's command line: every command's flags (their checks, defaults and help), the
// defaults that depend on which flags were given, and the parse. This is the one file of the CLI
// that includes CLI11: each command (probe.cpp, doctor.cpp, symmetric_check.cpp, stress.cpp,
// rl_loop.cpp) takes its options as a plain struct (commands.hpp) and returns its exit code.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "commands.hpp"
#include "common/options.hpp"
#include "launch/launch.hpp"
#include "stress/model_flags.hpp"
#include "stress/rl_loop.hpp"
#include "stress/stress_plan.hpp"
#include "symmetric_check.hpp"
#include "torpor/backend.hpp"
#include "torpor/group.hpp"
#include "torpor/torpor.h"

namespace torpor::cli {

namespace {

// --timeout (help text `help`) and the hidden --timeout-ms, the launcher's resolved value for its
// workers.
void add_group_timeout_flags(CLI::App* cmd, GroupTimeout& t, const std::string& help) {
  cmd->add_option("--timeout", t.seconds, help)->check(CLI::Range(1, max_timeout_s))->capture_default_str();
  cmd->add_option("--timeout-ms", t.worker_ms, "Internal: the launcher's resolved group timeout, in ms")
      ->check(CLI::Range(std::int64_t{1}, static_cast<std::int64_t>(max_group_timeout.count())))
      ->group("");
}

// Resolves the group timeout once the flags are parsed (launch.hpp says in which order).
void resolve_group_timeout(const CLI::App* cmd, GroupTimeout& t) {
  t.seconds_given = cmd->count("--timeout") > 0;
  t.resolve();
}

void add_model_flags(CLI::App* cmd, ModelFlags& f) {
  auto& c = f.config;
  const char* g = "Model";
  cmd->add_option("--vocab", c.vocab, "Vocabulary size")->capture_default_str()->group(g);
  cmd->add_option("--hidden", c.hidden, "Hidden size (a multiple of 64)")->capture_default_str()->group(g);
  cmd->add_option("--layers", c.layers, "Layers")->capture_default_str()->group(g);
  cmd->add_option("--head-dim", c.head_dim, "Attention head size (one head)")->capture_default_str()->group(g);
  cmd->add_option("--experts", c.experts, "Routed experts per layer")->capture_default_str()->group(g);
  cmd->add_option("--top-k", c.top_k, "Experts per token")->capture_default_str()->group(g);
  cmd->add_option("--latent", c.latent, "Latent dimension the experts work in")->capture_default_str()->group(g);
  cmd->add_option("--inter", c.inter, "Expert intermediate size, sharded over the ranks (a multiple of --ranks)")
      ->capture_default_str()
      ->group(g);
  cmd->add_option("--shared-inter", c.shared_inter, "Shared expert intermediate size, sharded; 0 = no shared expert")
      ->capture_default_str()
      ->group(g);
  // Bounded so that prompt_len + new_tokens and every product of them with the batch fit in an
  // int (issue 33 N18: a signed overflow before).
  cmd->add_option("--prompts", f.prompts, "Prompts decoded together (the batch), 1 to 4096")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096))
      ->group(g);
  cmd->add_option("--prompt-len", f.prompt_len, "Tokens per prompt, 1 to 65536")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536))
      ->group(g);
  cmd->add_option("--new-tokens", f.new_tokens, "Tokens generated per prompt, 1 to 65536")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536))
      ->group(g);
  cmd->add_option("--seed", f.seed, "Seed of the dummy weights and prompts")->capture_default_str()->group(g);
  cmd->add_option("--wait-timeout-ms", f.wait_timeout_ms, "Bound on every wait of the MoE tail, in ms")
      ->capture_default_str()
      ->group(g);
  cmd->add_flag("--no-graphs", f.no_graphs, "Run decode steps eagerly instead of replaying CUDA graphs")->group(g);
  cmd->add_flag(
         "--unfused", f.unfused,
         "Take the tail's default (unfused) path even where the fused one can be built; the tokens must be the same")
      ->group(g);
}

// What every command that runs the model over ranks ends its flags with: --timeout (every group
// wait, in seconds), --no-progress, the model's flags, and the hidden --worker (one rank of a
// process launch).
void add_rank_run_flags(CLI::App* cmd, GroupTimeout& group_timeout, bool& progress, ModelFlags& model, bool& worker) {
  add_group_timeout_flags(cmd, group_timeout,
                          "Bound on every group wait, in seconds (default: TORPOR_GROUP_TIMEOUT_MS when set)");
  cmd->add_flag(
      "--no-progress", [&progress](std::int64_t) { progress = false; }, "No progress line on the terminal");
  add_model_flags(cmd, model);
  cmd->add_flag("--worker", worker, "Internal: run as one rank (group from the environment)")->group("");
}

void add_probe(CLI::App& app, int& exit_code) {
  auto* cmd =
      app.add_subcommand("probe", "Report the backend, devices, VMM support, peer access and multicast decision");
  auto o = std::make_shared<ProbeOptions>();
  cmd->add_option("--backend", o->backend,
                  fmt::format("{}; auto follows {} when it is set", backends_in_words.view(),
                              options::option(options::id::backend).name))
      ->check(CLI::IsMember(backend_name_strings()));
  cmd->add_flag("--json", o->json, "Print one JSON document instead of the human-readable report");
  cmd->add_flag("--config", o->config,
                "Print the effective settings (every environment variable torpor reads: value, and whether it "
                "came from the environment or is the default) instead of probing; exits 1 when one is invalid");
  cmd->callback([o, &exit_code] { exit_code = run_probe(*o); });
}

void add_doctor(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "doctor",
      "Check whether torpor can run at full speed here and say the fix for each finding. Exit status: 0 full speed; "
      "1 runs, with a slow or limited finding; 2 the GPU cannot be used (with --backend host: never); other values: "
      "a usage error");
  auto o = std::make_shared<DoctorOptions>();
  cmd->add_option("--backend", o->backend,
                  fmt::format("{}; judged for a GPU, except {} (the emulator: judges the host side only)",
                              backends_in_words.view(), to_string(Backend::host)))
      ->check(CLI::IsMember(backend_name_strings()));
  cmd->add_flag("--json", o->json, "Print one JSON document (backend, checks, exit_code, full_speed, verdict)");
  cmd->add_option("--host-store", o->host_store,
                  "Host memory the store will page-lock, bytes (K, M, G, T suffixes), for the memlock check; default "
                  "the machine's host memory")
      ->transform([](const std::string& text) {
        try {
          return std::to_string(parse_size(text));
        } catch (const std::exception& e) {
          throw CLI::ValidationError("--host-store", e.what());
        }
      });
  cmd->callback([o, &exit_code] { exit_code = run_doctor(*o); });
}

void add_symmetric_check(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("symmetric-check",
                                 "Symmetric memory across processes (one per device): peer writes, sleep level 2, "
                                 "memory returned, wake, addresses and bytes intact");
  auto o = std::make_shared<SymmetricCheckOptions>();
  cmd->add_option("--ranks", o->ranks, "Processes, one per device (default 2)");
  cmd->add_option("--nodes", o->nodes,
                  "Emulated nodes (host backend): the ranks in this many groups that share no Unix socket and meet "
                  "over TCP on loopback, sharing memory as fabric handles (default 1)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--bytes", o->bytes, "Symmetric buffer size per rank, K/M/G suffixes (default 1G)");
  cmd->add_option("--backend", o->backend, std::string(backends_in_words.view()))
      ->check(CLI::IsMember(backend_name_strings()));
  cmd->add_option("--json", o->json, "Also write the results to this file");
  add_group_timeout_flags(cmd, o->timeout,
                          "Group timeout in seconds (default: TORPOR_GROUP_TIMEOUT_MS when set, else 120)");
  cmd->add_option("--group", o->group, "unix (Unix socket rendezvous) or nccl (bytes over NCCL, fds over unix)")
      ->check(CLI::IsMember({"unix", "nccl"}));
  cmd->add_flag("--timeout-check", o->timeout_check,
                "Also check that a missing rank is named in a timeout and that recover() restores the group");
  cmd->add_flag("--worker", o->worker, "Internal: run as one rank (group from the environment)")->group("");
  cmd->callback([o, cmd, &exit_code] {
    resolve_group_timeout(cmd, o->timeout);
    exit_code = run_symmetric_check(*o);
  });
}

void add_stress(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "stress",
      "The sleep-mode test plan on a tiny MoE model over N ranks: generate twice, sleep(1) + wake, twice sleep(2) + "
      "wake weights + reload + wake kv_cache, optional soak cycles; every output compared token for token with the "
      "first");
  auto o = std::make_shared<StressOptions>();
  cmd->add_option("--ranks", o->ranks, "Tensor-parallel ranks (default: every GPU on cuda, 2 on host)");
  cmd->add_flag("--processes", o->processes, "One process per rank and device (Unix socket group) instead of threads");
  cmd->add_option("--nodes", o->nodes,
                  "With --processes: the ranks in this many emulated nodes that share no Unix socket and meet over "
                  "TCP on loopback (default 1)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--backend", o->backend, std::string(backends_in_words.view()))
      ->check(CLI::IsMember(backend_name_strings()))
      ->capture_default_str();
  cmd->add_option("--cycles", o->cycles, "Soak: this many more sleep/wake cycles, mixed levels and partial wakes")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--fill-on-wake", o->fill,
                  "What discarded bytes hold on wake: poison (NaN: a missed reload shows), zero, none")
      ->check(CLI::IsMember({"poison", "zero", "none"}))
      ->capture_default_str();
  cmd->add_option("--preserve", o->preserve,
                  "Glob of parameter names kept by level 2 (offloaded) instead of reloaded; repeatable "
                  "(e.g. 'layers.*.moe.experts.*')");
  cmd->add_option(
         "--negative-control", o->negative_control,
         "zero-flags: after the first level-2 wake, zero the tail's slots and control blocks on one rank; "
         "the run must then fail, naming the rank and the op (exit non-zero); the tail's wait bound is then 2000 ms "
         "and the group's that plus 10 s, unless given. stale-weights: level 2 keeps every parameter and the reload "
         "skips them while the weight version advances, so the outputs differ from a freshly built model's; the run "
         "must fail")
      ->check(CLI::IsMember({"zero-flags", "stale-weights"}));
  cmd->add_option("--negative-control-rank", o->negative_rank,
                  "The rank whose tail state is zeroed (default: the last)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", o->json, "Also write the results as JSON to this file ('-': JSON on stdout, no table)");
  add_rank_run_flags(cmd, o->group_timeout, o->progress, o->model, o->worker);
  cmd->callback([o, cmd, &exit_code] {
    if (!o->negative_control.empty()) {
      // A short wait bound, so the failure comes quickly; the group's bound just above it.
      if (cmd->count("--wait-timeout-ms") == 0) o->model.wait_timeout_ms = 2000;
      if (cmd->count("--timeout") == 0) o->group_timeout.seconds = o->model.wait_timeout_ms / 1000 + 10;
    }
    resolve_group_timeout(cmd, o->group_timeout);
    exit_code = run_stress(*o);
  });
}

void add_rl_loop(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "rl-loop",
      "The RL weight-update loop on the tiny MoE model: sleep(2), a training phase in the returned memory outside the "
      "pool, wake weights, load updated weights, wake kv_cache, generate; outputs compared with a freshly built model");
  auto o = std::make_shared<RlOptions>();
  cmd->add_option("--iterations", o->iterations, "Weight updates")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--ranks", o->ranks, "Tensor-parallel ranks (default: every GPU on cuda, 2 on host)");
  cmd->add_flag("--processes", o->processes, "One process per rank and device instead of threads");
  cmd->add_option("--backend", o->backend, std::string(backends_in_words.view()))
      ->check(CLI::IsMember(backend_name_strings()))
      ->capture_default_str();
  cmd->add_option("--update-seed", o->update_seed, "Seed of the weight updates")->capture_default_str();
  cmd->add_option("--update-scale", o->update_scale, "Size of one update, relative to the weights' scale")
      ->capture_default_str();
  cmd->add_option("--train-fraction", o->train_fraction,
                  "Share of the returned memory the training phase takes (0.9 .. 1)")
      ->capture_default_str();
  cmd->add_option("--train-cap", o->train_cap,
                  "Host backend only: at most this much host memory for the training phase")
      ->capture_default_str();
  cmd->add_option("--json", o->json, "Also write the results as JSON to this file");
  add_rank_run_flags(cmd, o->group_timeout, o->progress, o->model, o->worker);
  cmd->callback([o, cmd, &exit_code] {
    resolve_group_timeout(cmd, o->group_timeout);
    exit_code = run_rl_loop(*o);
  });
}

}  // namespace

int run_command_line(int argc, char** argv) {
  CLI::App app{"torpor: a sleep-mode-aware GPU memory pool allocator on CUDA virtual memory"};
  app.require_subcommand(1);
  // The library's version (VERSION at the repository root, through torpor_version()): the CLI
  // reports what it runs on, so a stale libtorpor beside a new CLI shows here.
  app.set_version_flag("--version", std::string("torpor ") + torpor_version());
  int exit_code = 0;
  add_probe(app, exit_code);
  add_doctor(app, exit_code);
  add_symmetric_check(app, exit_code);
  add_stress(app, exit_code);
  add_rl_loop(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}

}  // namespace torpor::cli
