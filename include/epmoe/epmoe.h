// epmoe: one include for the whole C++ public API (the C ABI is epmoe/c_api.h).
#pragma once

#include "epmoe/comm.h"
#include "epmoe/config.h"
#include "epmoe/dispatch.h"
#include "epmoe/launcher.h"
#include "epmoe/layer.h"
#include "epmoe/status.h"
#include "epmoe/version.h"
#include "epmoe/workspace.h"
