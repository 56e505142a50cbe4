-- edgefeed: position-checked writes of entity values (vectors or tombstones).
-- KEYS[i]: an entity key; ARGV[2i-1]: its new value; ARGV[2i]: TTL in ms (0: none).
-- A value carries its source position (LSN, order in transaction) big-endian
-- at bytes 13..24; the new value is stored only when its position is strictly
-- later than the stored one, so redelivered and reordered events leave the
-- same state. A scheduled value (flag bit 1: windows read as of the read time)
-- at the same position as the stored one replaces it when written later: the
-- same state, with its schedule renewed. Returns per key: 1 written, 0 refused
-- (not newer), -1 the key holds something that is not an edgefeed value (left
-- untouched).
local results = {}
for i = 1, #KEYS do
  local new = ARGV[2 * i - 1]
  local ttl = tonumber(ARGV[2 * i])
  local old = redis.call('GET', KEYS[i])
  local verdict = 1
  if old then
    if string.len(old) < 40 or string.sub(old, 1, 2) ~= 'EF' then
      verdict = -1
    else
      local oh, ol, os = struct.unpack('>I4I4I4', string.sub(old, 13, 24))
      local nh, nl, ns = struct.unpack('>I4I4I4', string.sub(new, 13, 24))
      if nh < oh or (nh == oh and (nl < ol or (nl == ol and ns < os))) then
        verdict = 0
      elseif nh == oh and nl == ol and ns == os then
        if string.byte(new, 4) % 4 < 2 or string.len(old) ~= string.len(new) then
          verdict = 0
        else
          local ow = struct.unpack('<i8', string.sub(old, 33, 40))
          local nw = struct.unpack('<i8', string.sub(new, 33, 40))
          if nw <= ow then
            verdict = 0
          end
        end
      end
    end
  end
  if verdict == 1 then
    if ttl > 0 then
      redis.call('SET', KEYS[i], new, 'PX', ttl)
    else
      redis.call('SET', KEYS[i], new)
    end
  end
  results[i] = verdict
end
return results
