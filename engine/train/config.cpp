#include "engine/train/config.h"

#include <cctype>
#include <cmath>
#include <limits>

#include "common/json_config.h"
#include "common/json_parse.h"

namespace strata::engine {

Status apply_overrides(nlohmann::json* j, const std::vector<std::string>& overrides) {
  for (const std::string& o : overrides) {
    const size_t eq = o.find('=');
    if (eq == std::string::npos || eq == 0)
      return Status::invalid_argument("override '{}' must look like section.key=value", o);
    const std::string key = o.substr(0, eq);
    const std::string text = o.substr(eq + 1);
    Result<nlohmann::json> parsed = parse_json(text, "--set");
    // Else a bare string such as runs/demo (or 1e400, which the field's type check then names).
    nlohmann::json value = parsed.is_ok() ? std::move(parsed).value() : nlohmann::json(text);
    nlohmann::json* node = j;
    size_t start = 0;
    while (true) {
      const size_t dot = key.find('.', start);
      const std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (part.empty()) return Status::invalid_argument("override '{}': empty key component", o);
      if (!node->is_object())  // what the walk reached so far is a value
        return Status::invalid_argument("override '{}': {} is a value, not a section", o,
                                        start == 0 ? std::string("the config's top level") : key.substr(0, start - 1));
      if (dot == std::string::npos) {
        (*node)[part] = value;
        break;
      }
      node = &(*node)[part];
      if (node->is_null()) *node = nlohmann::json::object();
      start = dot + 1;
    }
  }
  return Status::ok();
}

namespace {

// DeepSpeed's top-level training keys, so that a ds_config.json's settings carry over beside its
// zero_optimization section: each is moved to the key it means here (an error when both are set and differ),
// and what has no counterpart here is refused by name.
Status apply_deepspeed_keys(nlohmann::json* j, const std::string& source) {
  auto section = [&](const char* name) -> nlohmann::json& {
    nlohmann::json& s = (*j)[name];
    if (s.is_null()) s = nlohmann::json::object();
    return s;
  };
  // Sets section.key to `value`, which DeepSpeed's setting `from` ("key = value") asked for.
  auto place = [&](const std::string& from, const nlohmann::json& value, const char* sec, const char* key) -> Status {
    nlohmann::json& s = section(sec);
    if (!s.is_object()) return Status::ok();  // the parser names a section that is not an object
    if (s.contains(key) && s[key] != value)
      return Status::invalid_argument("{}: {} and {}.{} = {} say different things; keep one", source, from, sec, key,
                                      json_excerpt(s[key]));
    s[key] = value;
    return Status::ok();
  };
  // Hugging Face's integration writes "auto" where its own arguments decide: here our setting stands.
  auto is_auto = [](const nlohmann::json& v) { return v.is_string() && v == "auto"; };
  auto take = [&](const char* from, const char* sec, const char* key) -> Status {
    if (!j->contains(from)) return Status::ok();
    const nlohmann::json value = (*j)[from];
    j->erase(from);
    if (is_auto(value)) return Status::ok();
    return place(fmt::format("{} = {}", from, json_excerpt(value)), value, sec, key);
  };
  STRATA_RETURN_IF_ERROR(take("train_micro_batch_size_per_gpu", "training", "batch_size"));
  STRATA_RETURN_IF_ERROR(take("gradient_accumulation_steps", "training", "grad_accum_steps"));
  STRATA_RETURN_IF_ERROR(take("gradient_clipping", "training", "grad_clip"));
  STRATA_RETURN_IF_ERROR(take("train_batch_size", "training", "global_batch_size"));
  STRATA_RETURN_IF_ERROR(take("steps_per_print", "training", "log_every"));
  for (const char* dtype : {"bf16", "fp16"}) {
    if (!j->contains(dtype)) continue;
    const nlohmann::json v = (*j)[dtype];
    j->erase(dtype);
    if (!v.is_object())
      return Status::invalid_argument("{}: {} must be an object like {{\"enabled\": true}}", source, dtype);
    const nlohmann::json enabled = v.value("enabled", nlohmann::json(false));
    if (is_auto(enabled)) continue;
    if (!enabled.is_boolean())
      return Status::invalid_argument("{}: {}.enabled must be true, false or \"auto\", got {}", source, dtype,
                                      json_excerpt(enabled));
    if (!enabled.get<bool>()) continue;  // its other settings (loss_scale, ...) do not matter then
    for (const auto& [k, _] : v.items()) {
      if (k != "enabled")
        return Status::invalid_argument("{}: {}.{} is not supported (only {}.enabled)", source, dtype, k, dtype);
    }
    if (std::string(dtype) == "fp16")
      return Status::invalid_argument("{}: fp16.enabled = true is not supported (no fp16 loss scaling); use "
                                      "\"bf16\": {{\"enabled\": true}} or compute.matmul_precision \"bf16\"",
                                      source);
    // bf16 matmul inputs with fp32 accumulation, fp32 master weights and moments: the closest this engine has.
    STRATA_RETURN_IF_ERROR(place("bf16.enabled = true", "bf16", "compute", "matmul_precision"));
  }
  if (j->contains("optimizer")) {
    const nlohmann::json o = (*j)["optimizer"];
    j->erase("optimizer");
    if (!o.is_object() || (o.contains("type") && !o["type"].is_string()))
      return Status::invalid_argument("{}: optimizer must be an object with a \"type\" (\"AdamW\" or \"Adam\")",
                                      source);
    std::string type = o.value("type", std::string("AdamW"));
    std::string lower = type;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (lower != "adamw" && lower != "adam")
      return Status::invalid_argument("{}: optimizer.type \"{}\" is not supported; the engine's optimizer is AdamW",
                                      source, type);
    for (const auto& [k, _] : o.items()) {
      if (k != "type" && k != "params")
        return Status::invalid_argument("{}: unknown key 'optimizer.{}'; valid keys: params, type", source, k);
    }
    const nlohmann::json p = o.value("params", nlohmann::json::object());
    if (!p.is_object()) return Status::invalid_argument("{}: optimizer.params must be an object", source);
    for (const auto& [k, v] : p.items()) {
      const std::string from = fmt::format("optimizer.params.{} = {}", k, json_excerpt(v));
      if (is_auto(v)) continue;
      if (k == "lr") {
        STRATA_RETURN_IF_ERROR(place(from, v, "training", "lr"));
        // DeepSpeed without a scheduler keeps the rate constant: so here, unless the file sets the schedule.
        // (A schedule, not a min_lr equal to this rate, so that an --lr given with the file stays constant too.)
        nlohmann::json& t = section("training");
        if (t.is_object() && !t.contains("min_lr") && !t.contains("lr_schedule")) t["lr_schedule"] = "constant";
        if (t.is_object() && !t.contains("warmup_steps")) t["warmup_steps"] = 0;
      } else if (k == "eps") {
        STRATA_RETURN_IF_ERROR(place(from, v, "training", "eps"));
      } else if (k == "weight_decay") {
        STRATA_RETURN_IF_ERROR(place(from, v, "training", "weight_decay"));
      } else if (k == "betas") {
        if (!v.is_array() || v.size() != 2)
          return Status::invalid_argument("{}: optimizer.params.betas must be [beta1, beta2]", source);
        STRATA_RETURN_IF_ERROR(place(from, v[0], "training", "beta1"));
        STRATA_RETURN_IF_ERROR(place(from, v[1], "training", "beta2"));
      } else if (k == "adam_w_mode" || k == "torch_adam") {
        if (k == "adam_w_mode" && v != true)
          return Status::invalid_argument("{}: optimizer.params.adam_w_mode = false (Adam with L2 in the gradient) is "
                                          "not supported; the engine's optimizer is AdamW",
                                          source);
      } else {
        return Status::invalid_argument("{}: unknown key 'optimizer.params.{}'; valid keys: lr, betas, eps, "
                                        "weight_decay, adam_w_mode, torch_adam",
                                        source, k);
      }
    }
  }
  if (j->contains("scheduler"))
    return Status::invalid_argument("{}: scheduler is not supported; the schedule is a linear warmup then a cosine "
                                    "decay: set training.warmup_steps, training.lr and training.min_lr",
                                    source);
  return Status::ok();
}

}  // namespace

namespace {

// The training section, checked on its own and against the model's context.
Status parse_training(JsonSection& root, const std::string& source, const ModelConfig& model, TrainingConfig* out) {
  TrainingConfig& t = *out;
  JsonSection tr = root.section("training");
  STRATA_RETURN_IF_ERROR(tr.get_int("batch_size", &t.batch_size));
  STRATA_RETURN_IF_ERROR(tr.get_int("seq_len", &t.seq_len));
  STRATA_RETURN_IF_ERROR(tr.get_int("grad_accum_steps", &t.grad_accum_steps));
  STRATA_RETURN_IF_ERROR(tr.get_int("max_steps", &t.max_steps));
  STRATA_RETURN_IF_ERROR(tr.get_double("lr", &t.lr));
  t.min_lr = std::numeric_limits<double>::quiet_NaN();  // not in the file: from lr, below
  STRATA_RETURN_IF_ERROR(tr.get_double("min_lr", &t.min_lr));
  STRATA_RETURN_IF_ERROR(tr.get_int("warmup_steps", &t.warmup_steps));
  STRATA_RETURN_IF_ERROR(tr.get_string("lr_schedule", &t.lr_schedule));
  STRATA_RETURN_IF_ERROR(tr.get_double("weight_decay", &t.weight_decay));
  STRATA_RETURN_IF_ERROR(tr.get_double("beta1", &t.beta1));
  STRATA_RETURN_IF_ERROR(tr.get_double("beta2", &t.beta2));
  STRATA_RETURN_IF_ERROR(tr.get_double("eps", &t.eps));
  STRATA_RETURN_IF_ERROR(tr.get_double("grad_clip", &t.grad_clip));
  STRATA_RETURN_IF_ERROR(tr.get_int("seed", &t.seed));
  STRATA_RETURN_IF_ERROR(tr.get_int("val_every", &t.val_every));
  STRATA_RETURN_IF_ERROR(tr.get_int("val_batches", &t.val_batches));
  STRATA_RETURN_IF_ERROR(tr.get_int("checkpoint_every", &t.checkpoint_every));
  STRATA_RETURN_IF_ERROR(tr.get_string("checkpoint_dir", &t.checkpoint_dir));
  STRATA_RETURN_IF_ERROR(tr.get_int("keep_checkpoints", &t.keep_checkpoints));
  STRATA_RETURN_IF_ERROR(tr.get_bool("overwrite_checkpoints", &t.overwrite_checkpoints));
  STRATA_RETURN_IF_ERROR(tr.get_int("log_every", &t.log_every));
  STRATA_RETURN_IF_ERROR(tr.get_string("init_from", &t.init_from));
  STRATA_RETURN_IF_ERROR(tr.get_bool("init_from_allow_non_finite", &t.init_from_allow_non_finite));
  STRATA_RETURN_IF_ERROR(tr.get_int("global_batch_size", &t.global_batch_size));
  STRATA_RETURN_IF_ERROR(tr.finish());

  auto bad = [&](const char* key, const std::string& why) {
    return Status::invalid_argument("{}: training.{} {}", source, key, why);
  };
  if (t.batch_size <= 0) return bad("batch_size", fmt::format("must be positive, got {}", t.batch_size));
  if (t.seq_len <= 0) return bad("seq_len", fmt::format("must be positive, got {}", t.seq_len));
  if (t.seq_len > model.context()) {
    return bad("seq_len", fmt::format("({}) is longer than the model's context, {} ({})", t.seq_len,
                                      model.context_key(), model.context()));
  }
  if (t.grad_accum_steps <= 0) return bad("grad_accum_steps", "must be positive");
  if (t.max_steps < 0) return bad("max_steps", "must be >= 0");
  if (!(t.lr >= 0)) return bad("lr", "must be >= 0");
  // The optimizer runs in float: 1e308 would be inf there, and train to NaN.
  if (!(t.lr <= std::numeric_limits<float>::max()))
    return bad("lr", fmt::format("({}) is past a float's range; the optimizer computes in float", t.lr));
  if (t.lr_schedule == "constant") {
    if (!std::isnan(t.min_lr))
      return bad("min_lr", fmt::format("({}) has no meaning with training.lr_schedule \"constant\"", t.min_lr));
    t.min_lr = t.lr;
  } else if (t.lr_schedule != "cosine") {
    return bad("lr_schedule", fmt::format("must be \"cosine\" or \"constant\", got \"{}\"", t.lr_schedule));
  }
  if (std::isnan(t.min_lr)) t.min_lr = t.lr / 10;  // nanoGPT's and llm.c's ratio
  if (!(t.min_lr >= 0 && t.min_lr <= t.lr))
    return bad("min_lr", fmt::format("({}) must be in [0, lr = {}]", t.min_lr, t.lr));
  if (t.warmup_steps < 0) return bad("warmup_steps", "must be >= 0");
  if (!(t.beta1 >= 0 && t.beta1 < 1)) return bad("beta1", "must be in [0, 1)");
  if (!(t.beta2 >= 0 && t.beta2 < 1)) return bad("beta2", "must be in [0, 1)");
  if (!(t.eps > 0)) return bad("eps", "must be > 0");
  if (!(t.grad_clip >= 0)) return bad("grad_clip", "must be >= 0 (0 disables clipping)");
  if (t.val_every < 0 || t.val_batches < 0) return bad("val_every", "and val_batches must be >= 0");
  if (t.checkpoint_every < 0) return bad("checkpoint_every", "must be >= 0");
  if (t.keep_checkpoints < 0) return bad("keep_checkpoints", "must be >= 0");
  if (t.log_every <= 0) return bad("log_every", "must be positive");
  if (t.checkpoint_dir.empty()) return bad("checkpoint_dir", "must not be empty");
  if (t.global_batch_size < 0) return bad("global_batch_size", "(train_batch_size) must be >= 0");
  if (t.global_batch_size > 0 &&
      t.global_batch_size % (static_cast<int64_t>(t.batch_size) * t.grad_accum_steps) != 0)
    return bad("global_batch_size", fmt::format("(train_batch_size) {} is not a multiple of batch_size {} x "
                                                "grad_accum_steps {}",
                                                t.global_batch_size, t.batch_size, t.grad_accum_steps));
  return Status::ok();
}

// The compute section: the device, the kernels and the matmuls' precision.
Status parse_compute(JsonSection& root, const std::string& source, ComputeConfig* out) {
  ComputeConfig& compute = *out;
  JsonSection co = root.section("compute");
  STRATA_RETURN_IF_ERROR(co.get_string("device", &compute.device));
  STRATA_RETURN_IF_ERROR(co.get_string("kernels", &compute.kernels));
  std::string precision = "fp32";
  STRATA_RETURN_IF_ERROR(co.get_string("matmul_precision", &precision));
  STRATA_RETURN_IF_ERROR(co.get_int("threads", &compute.threads));
  STRATA_RETURN_IF_ERROR(co.get_bool("bf16_working_copies", &compute.bf16_working_copies));
  STRATA_RETURN_IF_ERROR(co.finish());
  if (compute.kernels != "fast" && compute.kernels != "reference") {
    return Status::invalid_argument("{}: compute.kernels must be \"fast\" or \"reference\", got \"{}\"", source,
                                    compute.kernels);
  }
  if (compute.device != "auto" && compute.device != "cpu" && compute.device != "cuda") {
    return Status::invalid_argument("{}: compute.device must be \"auto\", \"cpu\" or \"cuda\", got \"{}\"", source,
                                    compute.device);
  }
  if (compute.device == "cuda" && compute.kernels == "reference") {
    return Status::invalid_argument("{}: compute.kernels = \"reference\" is the plain CPU reference; it cannot run "
                                    "with compute.device = \"cuda\"", source);
  }
  if (precision == "fp32" || precision == "f32") {
    compute.matmul_precision = kernels::MatmulPrecision::kF32;
  } else if (precision == "bf16") {
    compute.matmul_precision = kernels::MatmulPrecision::kBF16;
  } else {
    return Status::invalid_argument("{}: compute.matmul_precision must be \"fp32\" or \"bf16\", got \"{}\"", source,
                                    precision);
  }
  if (compute.threads < 0) return Status::invalid_argument("{}: compute.threads must be >= 0", source);
  return Status::ok();
}

// The parallel section, checked against the model, the batch and the device.
Status parse_parallel(JsonSection& root, const std::string& source, const RunConfig& c, ParallelConfig* out) {
  ParallelConfig& parallel = *out;
  JsonSection pa = root.section("parallel");
  STRATA_RETURN_IF_ERROR(pa.get_int("tensor_parallel_size", &parallel.tensor_parallel_size));
  STRATA_RETURN_IF_ERROR(pa.get_int("pipeline_parallel_size", &parallel.pipeline_parallel_size));
  STRATA_RETURN_IF_ERROR(pa.get_string("pipeline_schedule", &parallel.pipeline_schedule));
  STRATA_RETURN_IF_ERROR(pa.get_bool("sequence_parallel", &parallel.sequence_parallel));
  STRATA_RETURN_IF_ERROR(pa.get_string("distributed_backend", &parallel.distributed_backend));
  STRATA_RETURN_IF_ERROR(pa.finish());
  const std::string& backend = parallel.distributed_backend;
  if (backend != "auto" && backend != "nccl" && backend != "mpi")
    return Status::invalid_argument(
        "{}: parallel.distributed_backend must be \"auto\", \"nccl\" or \"mpi\", got \"{}\"", source, backend);
  if (backend == "nccl" && c.compute.device == "cpu")
    return Status::invalid_argument("{}: parallel.distributed_backend \"nccl\" carries GPU buffers; compute.device is "
                                    "\"cpu\" (use \"auto\" or \"mpi\")",
                                    source);
  if (parallel.pipeline_schedule != "1f1b" && parallel.pipeline_schedule != "gpipe")
    return Status::invalid_argument("{}: parallel.pipeline_schedule must be \"1f1b\" or \"gpipe\", got \"{}\"", source,
                                    parallel.pipeline_schedule);
  if (parallel.pipeline_parallel_size > c.model.layers())
    return Status::invalid_argument("{}: parallel.pipeline_parallel_size {} is more stages than the model's {} "
                                    "blocks",
                                    source, parallel.pipeline_parallel_size, c.model.layers());
  if (parallel.tensor_parallel_size < 1 || parallel.pipeline_parallel_size < 1)
    return Status::invalid_argument("{}: parallel.tensor_parallel_size and pipeline_parallel_size must be >= 1, got "
                                    "{} and {}",
                                    source, parallel.tensor_parallel_size, parallel.pipeline_parallel_size);
  const int64_t rows = static_cast<int64_t>(c.training.batch_size) * c.training.seq_len;
  if (parallel.sequence_parallel && rows % parallel.tensor_parallel_size != 0)
    return Status::invalid_argument("{}: parallel.sequence_parallel cuts training.batch_size x training.seq_len = {} "
                                    "rows over parallel.tensor_parallel_size {} ranks: they must divide evenly",
                                    source, rows, parallel.tensor_parallel_size);
  STRATA_RETURN_IF_ERROR(c.model.check_tensor_parallel(parallel.tensor_parallel_size).with_context(source));
  return Status::ok();
}

}  // namespace

Result<RunConfig> parse_run_config(const nlohmann::json& given, const std::string& source) {
  RunConfig c;
  c.source = source;
  nlohmann::json j = given;
  if (j.is_object()) STRATA_RETURN_IF_ERROR(apply_deepspeed_keys(&j, source));
  c.json = j;
  JsonSection root(&j, source, "");

  JsonSection m = root.section("model");
  // A Hugging Face folder to start from may fill the model section (its config.json).
  std::string init_from;
  if (j.is_object() && j.contains("training") && j["training"].is_object() && j["training"].contains("init_from") &&
      j["training"]["init_from"].is_string())
    init_from = j["training"]["init_from"].get<std::string>();
  STRATA_RETURN_IF_ERROR(read_model_section(&m, init_from, &c.model));
  STRATA_RETURN_IF_ERROR(m.finish());
  STRATA_RETURN_IF_ERROR(c.model.validate().with_context(source));

  JsonSection d = root.section("data");
  STRATA_RETURN_IF_ERROR(d.get_string("train", &c.data.train));
  STRATA_RETURN_IF_ERROR(d.get_string("val", &c.data.val));
  STRATA_RETURN_IF_ERROR(d.finish());

  STRATA_RETURN_IF_ERROR(parse_training(root, source, c.model, &c.training));
  STRATA_RETURN_IF_ERROR(parse_compute(root, source, &c.compute));
  STRATA_RETURN_IF_ERROR(parse_parallel(root, source, c, &c.parallel));
  STRATA_RETURN_IF_ERROR(parse_offload_config(root, source, &c.offload));
  STRATA_RETURN_IF_ERROR(root.finish());
  return c;
}

Result<RunConfig> load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  STRATA_ASSIGN_OR_RETURN(nlohmann::json j, read_json_file(path));
  if (!j.is_object()) return Status::invalid_argument("{}: the config must be a JSON object", path);
  // The file's DeepSpeed keys first, so that an override of the key they map to wins (--lr over optimizer.params).
  STRATA_RETURN_IF_ERROR(apply_deepspeed_keys(&j, path));
  STRATA_RETURN_IF_ERROR(apply_overrides(&j, overrides).with_context(path));
  return parse_run_config(j, path);
}

}  // namespace strata::engine
