// The C API's handles (include/epmoe/c_api.h declares them opaque): what each one owns and borrows.
// Not public API; c_api.cpp and the CPU tests of its lifetime rules include it.
#pragma once

#include "epmoe/comm.h"
#include "epmoe/config.h"
#include "epmoe/dispatch.h"
#include "epmoe/layer.h"
#include "epmoe/workspace.h"

struct epmoe_comm {
  epmoe::Communicator* comm = nullptr;  // owned; the NCCL comm inside may be borrowed (wrap)
  int rank = 0;
  int size = 0;
  int device = 0;
};

struct epmoe_dispatch {
  epmoe::DispatchHandle* handle = nullptr;  // owned
  epmoe_comm* comm = nullptr;               // borrowed; epmoe_comm_destroy refuses while the handle lives
};

struct epmoe_workspace {
  epmoe::Workspace* ws = nullptr;  // owned (a share of the buffers)
  epmoe_comm* comm = nullptr;      // borrowed; epmoe_comm_destroy refuses while the workspace lives
};

struct epmoe_layer {
  epmoe::MoELayer* layer = nullptr;  // owned (on a workspace: a share of its buffers)
  epmoe_comm* comm = nullptr;        // borrowed; epmoe_comm_destroy refuses while the layer lives
  epmoe::LayerConfig cfg;
};
