# Keeps vagrant/.ssh/known_hosts: one "ADDRESS ssh-ed25519 KEY" line per lab VM.
# Plain Ruby (no Vagrant API) so tests/test_vagrant.py can exercise it with `ruby`.
require "fileutils"

module HiddenplaneKnownHosts
  KEY_LINE = %r{\Assh-ed25519 ([A-Za-z0-9+/]{68})\z}
  BLOB_HEAD = [11, "ssh-ed25519", 32].pack("NA*N") # the wire format: string type, string key
  LOCK = Mutex.new # `vagrant up` on libvirt brings machines up in parallel threads

  module_function

  # "ssh-ed25519 AAAA... root@cp1\n" -> "ssh-ed25519 AAAA..."; raises on anything else, so a
  # garbled or unexpected answer is never written as a trusted key.
  def parse_public_key(text)
    fields = text.to_s.strip.split(/\s+/)
    key = fields[0, 2].join(" ")
    m = KEY_LINE.match(key)
    blob = m && (m[1].unpack1("m0") rescue nil)
    unless blob && blob.bytesize == BLOB_HEAD.bytesize + 32 && blob.start_with?(BLOB_HEAD)
      raise ArgumentError, "not an ssh-ed25519 public key: #{text.to_s.strip[0, 80].inspect}"
    end
    key
  end

  # Replace every line for `address` with "address key"; keep every other line as it is.
  def record(path, address, public_key_text)
    key = parse_public_key(public_key_text)
    update(path) { |lines| drop(lines, address) + ["#{address} #{key}"] }
  end

  def forget(path, address)
    return unless File.exist?(path)
    update(path) { |lines| drop(lines, address) }
  end

  def drop(lines, address)
    lines.reject { |l| l.split(/\s+/, 2).first.to_s.split(",").include?(address) }
  end

  def update(path)
    LOCK.synchronize do
      FileUtils.mkdir_p(File.dirname(path), mode: 0o700)
      File.open("#{path}.lock", File::RDWR | File::CREAT, 0o600) do |lock|
        lock.flock(File::LOCK_EX) # and against a second vagrant process
        lines = File.exist?(path) ? File.readlines(path, chomp: true).reject(&:empty?) : []
        tmp = "#{path}.tmp"
        File.open(tmp, "w", 0o600) { |f| yield(lines).each { |l| f.puts(l) } }
        File.rename(tmp, path)
      end
    end
  end
end
