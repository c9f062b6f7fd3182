# hutch on Nomad: one node (`hutch serve`) on every client that opts in,
# all nodes sharing one PostgreSQL database. Checked by tests/deploy, not
# run here (docs/deploy.md).
#
# On each client:
#   - the binaries in /usr/local/bin (scripts/install.sh with NO_START=1
#     installs them and the systemd unit, not started);
#   - raw_exec enabled (plugin "raw_exec" { config { enabled = true } });
#   - meta { hutch_node = "true" } in the client's configuration.
# The database URL and the fleet's shared secret (32 or more visible ASCII
# characters, signing the requests nodes forward to each other), in a
# Nomad variable this job reads (`var put` replaces all its items):
#   nomad var put nomad/jobs/hutch database_url=postgres://hutch:...@db:5432/hutch \
#     fleet_secret="$(openssl rand -hex 32)"
# The fleet's registry, if any (below):
#   nomad job run -var registry=https://registry.example.com/hutch hutch.nomad.hcl

# HUTCH_REGISTRY: the fleet's OCI registry (any Distribution-compatible
# one, the same for every node, readable and writable by the nodes only:
# it holds every tenant's files), as http[s]://host[:port][/prefix].
# Snapshots, sandboxes paused to disk and template builds are pushed there
# as they are made, so another node starts them. Empty: no registry, as in
# `hutch serve`.
variable "registry" {
  type    = string
  default = ""
}

# HUTCH_REGISTRY_INSECURE: allow plain HTTP to a registry that is not on
# loopback (a trusted network only).
variable "registry_insecure" {
  type    = bool
  default = false
}

job "hutch" {
  # One allocation per eligible client, like a DaemonSet.
  type = "system"

  constraint {
    attribute = "${meta.hutch_node}"
    value     = "true"
  }

  constraint {
    attribute = "${attr.kernel.name}"
    value     = "linux"
  }

  update {
    max_parallel = 1
    stagger      = "30s"
  }

  group "node" {
    network {
      # The host's network (raw_exec has no other): the API on the
      # client's address.
      port "http" {
        static = 7700
      }
    }

    service {
      name     = "hutch"
      provider = "nomad"
      port     = "http"

      check {
        name     = "healthz"
        type     = "http"
        path     = "/healthz"
        interval = "10s"
        timeout  = "3s"
      }
    }

    restart {
      attempts = 10
      interval = "5m"
      delay    = "5s"
      mode     = "delay"
    }

    task "hutch" {
      # raw_exec: as root, in the host's namespaces. hutch makes namespaces,
      # cgroups under /sys/fs/cgroup/hutch, nftables tables and veths in the
      # host's network namespace, loop devices and mounts (its btrfs
      # storage, overlays) on the host, and its sandboxes outlive it: the
      # exec driver's chroot, PID namespace and cgroup would hide the host
      # from it and end every sandbox with the task. raw_exec runs the
      # task as the client agent's user, root.
      driver = "raw_exec"

      config {
        command = "/usr/local/bin/hutch"
        args    = ["serve"]
      }

      # Nomad's runtime variables: the node's name and the address Nomad
      # gave the port (the client's); the database URL from the variable;
      # the fleet's shared secret from the file the second template writes.
      env {
        HUTCH_NODE              = "${node.unique.name}"
        HUTCH_LISTEN            = "${NOMAD_ADDR_http}"
        HUTCH_ADVERTISE         = "http://${NOMAD_ADDR_http}"
        HUTCH_STATE_DIR         = "/var/lib/hutch"
        HUTCH_HEARTBEAT         = "5s"
        HUTCH_FLEET_SECRET_FILE = "${NOMAD_SECRETS_DIR}/fleet.secret"
        HUTCH_REGISTRY          = var.registry
        HUTCH_REGISTRY_INSECURE = "${var.registry_insecure}"
      }

      template {
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/hutch" }}HUTCH_DATABASE={{ .database_url }}{{ end }}
        EOT
        destination = "secrets/database.env"
        env         = true
        # A new URL restarts the node (its sandboxes go on and are adopted).
        change_mode = "restart"
      }

      # The fleet's shared secret, as a file only the task's user (root)
      # reads; hutch reads it at start, so a new one restarts the node.
      template {
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/hutch" }}{{ .fleet_secret }}{{ end }}
        EOT
        destination = "secrets/fleet.secret"
        perms       = "0400"
        change_mode = "restart"
      }

      # SIGTERM: the daemon stops serving within 10s; sandboxes keep
      # running and the next start adopts them.
      kill_signal  = "SIGTERM"
      kill_timeout = "30s"

      # The daemon's own share (API, proxies, image builds); its sandboxes
      # live in hutch's cgroups, which Nomad does not count: keep the
      # client's memory for them (client reserved { memory = ... }).
      # memory_max applies where memory oversubscription is enabled.
      resources {
        cpu        = 500
        memory     = 1024
        memory_max = 4096
      }
    }
  }
}
