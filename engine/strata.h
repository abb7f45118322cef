// strata.h — Strata for a program that embeds it: the one header such a program includes.
//
//   RunConfig config = load_run_config(path, overrides)     the config (docs/configuration.md)
//   TrainSession::create(config, options)                   the device, data, model, optimizer and offload
//                                                           stack it asks for; the weights made, read from
//                                                           training.init_from, or resumed (options.resume)
//   session->step()                                         one optimizer step: loss, norm, time, offload report
//   session->validate()                                     the validation loss
//   session->save()                                         a checkpoint, which options.resume loads
//   run_training(config, options)                           the whole loop `strata train` runs
//   save_model / load_model                                 weights alone, ours or another project's
//
// Everything returns Status or Result<T> (common/status.h): errors name the file, key or value at fault.
// Examples: examples/train_loop.cpp, examples/offload_throughput.cpp.
#pragma once

#include "common/status.h"                   // IWYU pragma: export
#include "engine/checkpoint/checkpoint.h"    // IWYU pragma: export
#include "engine/train/config.h"             // IWYU pragma: export
#include "engine/train/session.h"            // IWYU pragma: export
#include "engine/train/trainer.h"            // IWYU pragma: export
